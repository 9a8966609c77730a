//! The hash kube-proxy derives its chain names from: the first characters of
//! `base32(sha256(text))` (16 in iptables mode, `KUBE-SVC-*`/`KUBE-SEP-*`; 8 in nftables
//! mode, `service-*`/`endpoint-*`). Not for anything secret.

use sha2::{Digest as _, Sha256};

const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// RFC 4648 base32 of `data` (standard alphabet, `=` padding: Go's
/// `base32.StdEncoding`) into `out`, as far as `out` reaches; returns the length written.
pub fn base32_into(data: &[u8], out: &mut [u8]) -> usize {
    let mut n = 0;
    for chunk in data.chunks(5) {
        let mut buf = [0u8; 5];
        buf[..chunk.len()].copy_from_slice(chunk);
        let bits = buf.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        // Characters that carry input bits: ceil(len * 8 / 5); the rest is padding.
        let used = (chunk.len() * 8).div_ceil(5);
        for i in 0..8 {
            if n == out.len() {
                return n;
            }
            out[n] = if i < used {
                BASE32[((bits >> (35 - 5 * i)) & 0x1f) as usize]
            } else {
                b'='
            };
            n += 1;
        }
    }
    n
}

/// The first `N` characters of `base32(sha256(text))` (N <= 52): kube-proxy's chain-name
/// hash, ASCII.
pub fn chain_hash<const N: usize>(text: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    base32_into(&Sha256::digest(text), &mut out);
    out
}

/// [`chain_hash`] as a string of `len` (<= 52) characters.
pub fn chain_hash_string(text: &str, len: usize) -> String {
    let hash = chain_hash::<52>(text.as_bytes());
    hash[..len.min(52)].iter().map(|&b| char::from(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_matches_rfc4648() {
        let cases: [(&[u8], &[u8]); 7] = [
            (b"", b""),
            (b"f", b"MY======"),
            (b"fo", b"MZXQ===="),
            (b"foo", b"MZXW6==="),
            (b"foob", b"MZXW6YQ="),
            (b"fooba", b"MZXW6YTB"),
            (b"foobar", b"MZXW6YTBOI======"),
        ];
        for (input, want) in cases {
            let mut out = [0u8; 16];
            let n = base32_into(input, &mut out);
            assert_eq!(&out[..n], want);
        }
    }

    #[test]
    fn chain_hashes_match_kube_proxy() {
        // The seed article's Service (iptables mode) and kube-proxy's nftables golden test.
        assert_eq!(
            &chain_hash::<16>(b"default/nginx-servicetcp"),
            b"V2OKYYMBY3REGZOG"
        );
        assert_eq!(&chain_hash::<8>(b"ns1/svc1/tcp/p80"), b"ULMVA6XW");
        assert_eq!(chain_hash_string("ns1/svc1/tcp/p80", 8), "ULMVA6XW");
    }
}
