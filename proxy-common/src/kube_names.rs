//! The hash kube-proxy derives its chain names from: the first characters of
//! `base32(sha256(text))` (16 in iptables mode, `KUBE-SVC-*`/`KUBE-SEP-*`; 8 in nftables
//! mode, `service-*`/`endpoint-*`). Shared by `proxyctl explain` and `cargo xtask bench`,
//! without a crypto dependency and without allocating. Not for anything secret.

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// One 64-byte block into the state (FIPS 180-4, 6.2.2).
fn compress(h: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for (i, word) in block.chunks_exact(4).enumerate() {
        w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16]
            .wrapping_add(s0)
            .wrapping_add(w[i - 7])
            .wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
    for i in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = hh
            .wrapping_add(s1)
            .wrapping_add(ch)
            .wrapping_add(K[i])
            .wrapping_add(w[i]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        hh = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
        *x = x.wrapping_add(y);
    }
}

/// The SHA-256 digest of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let mut h = H0;
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        compress(&mut h, block);
    }
    // The rest, 0x80, zeros, and the bit length as a big-endian u64: one or two blocks.
    let rest = blocks.remainder();
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let len = if rest.len() < 56 { 64 } else { 128 };
    tail[len - 8..len].copy_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in tail[..len].chunks_exact(64) {
        compress(&mut h, block);
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

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
    base32_into(&sha256(text), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> [u8; 64] {
        let mut out = [0u8; 64];
        for (i, x) in b.iter().enumerate() {
            out[2 * i] = b"0123456789abcdef"[usize::from(x >> 4)];
            out[2 * i + 1] = b"0123456789abcdef"[usize::from(x & 15)];
        }
        out
    }

    #[test]
    fn sha256_matches_the_fips_examples() {
        let cases: [(&[u8], &[u8; 64]); 5] = [
            (
                b"",
                b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            ),
            (
                b"abc",
                b"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            ),
            (
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
                b"248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
            ),
            // Around the padding boundaries: 56 bytes needs a second block, 64 a full one.
            (
                &[b'a'; 64],
                b"ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb",
            ),
            (
                &[b'a'; 55],
                b"9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(&hex(&sha256(input)), want, "{} bytes", input.len());
        }
    }

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
    }
}
