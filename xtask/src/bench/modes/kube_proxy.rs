//! kube-proxy's modes: [`Iptables`] (legacy or nft), [`Nftables`], [`Ipvs`], each
//! programming its rule text with kube-proxy's own commands.

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{new_stack, Ctx, MemCgroup, Mode, Timing};
use crate::bench::{
    iptables, ipvs, nftables,
    plan::Service,
    topo::{self, in_ns, ns_run, run_bounded, Stack},
};

/// Which iptables kube-proxy's iptables mode runs: `iptables-legacy` (x_tables) or
/// `iptables-nft` (the same rules through nf_tables).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum IptablesVariant {
    Legacy,
    Nft,
}

/// `cmd` runs in `memcg` when one is set (its kernel allocations charged there).
fn charge(memcg: &Option<Arc<MemCgroup>>, cmd: &mut Command) -> Result<()> {
    if let Some(cg) = memcg {
        cg.enter_before_exec(cmd)
            .with_context(|| format!("joining the memory cgroup {}", cg.path.display()))?;
    }
    Ok(())
}

/// kube-proxy's iptables mode, with the legacy (x_tables) or the nft backend.
pub struct Iptables {
    variant: IptablesVariant,
    stack: Option<Stack>,
    /// Where the restores' kernel memory (the tables) is charged.
    memcg: Option<Arc<MemCgroup>>,
}

impl Iptables {
    pub fn new(variant: IptablesVariant) -> Self {
        Self {
            variant,
            stack: None,
            memcg: None,
        }
    }

    fn tool(&self, what: &str) -> String {
        match self.variant {
            IptablesVariant::Legacy => format!("iptables-legacy{what}"),
            IptablesVariant::Nft => format!("iptables-nft{what}"),
        }
    }

    fn node(&self) -> Result<&topo::Netns> {
        Ok(&self.stack.as_ref().context("no stack")?.node)
    }

    /// `iptables-restore -w 5 --noflush --counters`, as kube-proxy runs it.
    fn restore(&self, input: &str, limit: Duration) -> Result<Option<Duration>> {
        let tool = self.tool("-restore");
        let mut cmd = in_ns(self.node()?, &tool, &["-w", "5", "--noflush", "--counters"]);
        charge(&self.memcg, &mut cmd)?;
        let t = Instant::now();
        let done = run_bounded(&mut cmd, input, limit)?;
        Ok(done.map(|_| t.elapsed()))
    }

    fn save_nat(&self, limit: Duration) -> Result<Option<(String, Duration)>> {
        let tool = self.tool("-save");
        let t = Instant::now();
        let out = run_bounded(&mut in_ns(self.node()?, &tool, &["-t", "nat"]), "", limit)?;
        Ok(out.map(|o| (o, t.elapsed())))
    }

    fn jump_rules(&self) -> Result<()> {
        self.restore(&iptables::jump_rules_restore(), Duration::from_secs(30))?
            .context("installing the jump rules took more than 30 s")?;
        Ok(())
    }
}

impl Mode for Iptables {
    fn name(&self) -> &'static str {
        match self.variant {
            IptablesVariant::Legacy => "iptables-legacy",
            IptablesVariant::Nft => "iptables-nft",
        }
    }
    fn describe(&self) -> &'static str {
        match self.variant {
            IptablesVariant::Legacy => {
                "kube-proxy iptables mode, legacy x_tables backend (iptables-legacy-restore)"
            }
            IptablesVariant::Nft => {
                "kube-proxy iptables mode, nf_tables backend (iptables-nft-restore)"
            }
        }
    }
    fn setup(&mut self, _: &Ctx) -> Result<(), String> {
        self.stack = Some(new_stack()?);
        self.jump_rules().map_err(|e| format!("{e:#}"))
    }
    fn stack(&self) -> Option<&Stack> {
        self.stack.as_ref()
    }
    fn charge_rules_to(&mut self, memcg: Option<Arc<MemCgroup>>) {
        self.memcg = memcg;
    }
    fn program(
        &mut self,
        _: &Ctx,
        services: &[Service],
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let rules = iptables::Rules::for_services(services);
        let text = rules.full(services);
        let mut timing = Timing::default();
        if !rules.large_cluster {
            // Outside large cluster mode every sync reads the nat table back first, to
            // find stale chains.
            let Some((_, d)) = self.save_nat(limit)? else {
                return Ok(None);
            };
            timing.step("iptables-save -t nat", d);
        }
        let Some(d) = self.restore(&text, limit)? else {
            return Ok(None);
        };
        timing.step("iptables-restore --noflush (full sync)", d);
        Ok(Some(timing))
    }
    fn change(
        &mut self,
        _: &Ctx,
        services: &[Service],
        _old: &Service,
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let rules = iptables::Rules::for_services(services);
        let mut timing = Timing::default();
        let mut stale = Vec::new();
        if !rules.large_cluster {
            let Some((save, d)) = self.save_nat(limit)? else {
                return Ok(None);
            };
            timing.step("iptables-save -t nat", d);
            stale = iptables::stale_chains(&save, services);
        }
        let changed = &services[services.len() - 1];
        let text = rules.partial(services, changed, &stale);
        let Some(d) = self.restore(&text, limit)? else {
            return Ok(None);
        };
        timing.step("iptables-restore --noflush (partial sync)", d);
        Ok(Some(timing))
    }
    fn clear(&mut self, _: &Ctx) -> Result<()> {
        let node = self.node()?;
        let tool = self.tool("");
        for table in ["nat", "filter"] {
            for op in ["-F", "-X"] {
                run_bounded(
                    &mut in_ns(node, &tool, &["-w", "5", "-t", table, op]),
                    "",
                    Duration::from_secs(600),
                )?
                .with_context(|| format!("{tool} -t {table} {op} took more than 600 s"))?;
            }
        }
        self.jump_rules()
    }
}

/// kube-proxy's nftables mode.
#[derive(Default)]
pub struct Nftables {
    stack: Option<Stack>,
    /// Where `nft`'s kernel memory (the ruleset) is charged.
    memcg: Option<Arc<MemCgroup>>,
}

impl Nftables {
    fn nft(&self, input: &str, limit: Duration) -> Result<Option<Duration>> {
        let node = &self.stack.as_ref().context("no stack")?.node;
        let mut cmd = in_ns(node, "nft", &["-f", "-"]);
        charge(&self.memcg, &mut cmd)?;
        let t = Instant::now();
        let done = run_bounded(&mut cmd, input, limit)?;
        Ok(done.map(|_| t.elapsed()))
    }
}

impl Mode for Nftables {
    fn name(&self) -> &'static str {
        "nftables"
    }
    fn describe(&self) -> &'static str {
        "kube-proxy nftables mode (one nft -f transaction per sync)"
    }
    fn charge_rules_to(&mut self, memcg: Option<Arc<MemCgroup>>) {
        self.memcg = memcg;
    }
    fn setup(&mut self, _: &Ctx) -> Result<(), String> {
        let stack = new_stack()?;
        ns_run(&stack.node, "nft", &["list", "tables"], "").map_err(|e| format!("{e:#}"))?;
        self.stack = Some(stack);
        Ok(())
    }
    fn stack(&self) -> Option<&Stack> {
        self.stack.as_ref()
    }
    fn program(
        &mut self,
        _: &Ctx,
        services: &[Service],
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let text = nftables::full(services);
        let Some(d) = self.nft(&text, limit)? else {
            return Ok(None);
        };
        let mut timing = Timing::default();
        timing.step("nft -f (full sync)", d);
        Ok(Some(timing))
    }
    fn change(
        &mut self,
        _: &Ctx,
        services: &[Service],
        old: &Service,
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let text = nftables::partial(&services[services.len() - 1], old);
        let Some(d) = self.nft(&text, limit)? else {
            return Ok(None);
        };
        let mut timing = Timing::default();
        timing.step("nft -f (partial sync)", d);
        Ok(Some(timing))
    }
    fn clear(&mut self, _: &Ctx) -> Result<()> {
        // Only kube-proxy's table lives in this (our) node namespace.
        let node = &self.stack.as_ref().context("no stack")?.node;
        run_bounded(
            &mut in_ns(node, "nft", &["flush", "ruleset"]),
            "",
            Duration::from_secs(600),
        )?
        .context("nft flush ruleset took more than 600 s")?;
        Ok(())
    }
}

/// kube-proxy's IPVS mode.
#[derive(Default)]
pub struct Ipvs {
    stack: Option<Stack>,
}

impl Ipvs {
    fn node(&self) -> Result<&topo::Netns> {
        Ok(&self.stack.as_ref().context("no stack")?.node)
    }

    fn timed(
        &self,
        timing: &mut Timing,
        name: &str,
        program: &str,
        args: &[&str],
        input: &str,
        limit: Duration,
    ) -> Result<bool> {
        let t = Instant::now();
        let done = run_bounded(&mut in_ns(self.node()?, program, args), input, limit)?;
        timing.step(name, t.elapsed());
        Ok(done.is_some())
    }
}

impl Mode for Ipvs {
    fn name(&self) -> &'static str {
        "ipvs"
    }
    fn describe(&self) -> &'static str {
        "kube-proxy IPVS mode (kube-ipvs0 dummy, rr virtual services, ipsets)"
    }
    fn setup(&mut self, _: &Ctx) -> Result<(), String> {
        let stack = new_stack()?;
        if let Err(e) = ns_run(&stack.node, "ipvsadm", &["-Ln"], "") {
            let e = format!("{e:#}");
            let kernel = std::fs::read("/proc/config.gz").ok().and_then(|_| {
                let out = Command::new("sh")
                    .args([
                        "-c",
                        "zcat /proc/config.gz | grep -E '^(# )?CONFIG_IP_VS( |=)'",
                    ])
                    .output()
                    .ok()?;
                Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
            });
            return Err(match kernel {
                Some(k) if k.contains("is not set") => {
                    format!(
                        "{}IPVS ({k}); ipvsadm: {}",
                        super::KERNEL_LACKS,
                        e.lines().last().unwrap_or("")
                    )
                }
                _ => format!("IPVS does not work here: {e}"),
            });
        }
        let setup = || -> Result<()> {
            stack
                .node
                .ip(&["link", "add", "kube-ipvs0", "type", "dummy"]);
            for (k, v) in ipvs::SYSCTLS {
                ns_run(&stack.node, "sysctl", &["-qw", &format!("{k}={v}")], "")?;
            }
            ns_run(
                &stack.node,
                "iptables-restore",
                &["-w", "5", "--noflush"],
                &ipvs::iptables_rules(),
            )?;
            Ok(())
        };
        setup().map_err(|e| format!("{e:#}"))?;
        self.stack = Some(stack);
        Ok(())
    }
    fn stack(&self) -> Option<&Stack> {
        self.stack.as_ref()
    }
    fn program(
        &mut self,
        _: &Ctx,
        services: &[Service],
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let mut timing = Timing::default();
        let steps: [(&str, &str, Vec<&str>, String); 3] = [
            (
                "ClusterIPs on kube-ipvs0 (ip -batch)",
                "ip",
                vec!["-batch", "-"],
                ipvs::addresses(services),
            ),
            (
                "ipsets (ipset restore)",
                "ipset",
                vec!["restore"],
                ipvs::ipsets(services),
            ),
            (
                "virtual servers (ipvsadm -R)",
                "ipvsadm",
                vec!["-R"],
                ipvs::virtual_servers(services),
            ),
        ];
        for (name, program, args, input) in steps {
            let left = limit.saturating_sub(Duration::from_secs_f64(timing.seconds));
            if !self.timed(&mut timing, name, program, &args, &input, left)? {
                return Ok(None);
            }
        }
        Ok(Some(timing))
    }
    fn change(
        &mut self,
        _: &Ctx,
        services: &[Service],
        old: &Service,
        limit: Duration,
    ) -> Result<Option<Timing>> {
        let new = &services[services.len() - 1];
        let mut timing = Timing::default();
        let done = self.timed(
            &mut timing,
            "ipvsadm -R (real servers)",
            "ipvsadm",
            &["-R"],
            &ipvs::change(old, new),
            limit,
        )?;
        Ok(done.then_some(timing))
    }
    fn clear(&mut self, _: &Ctx) -> Result<()> {
        let node = self.node()?;
        ns_run(node, "ipvsadm", &["-C"], "")?;
        ns_run(node, "ip", &["addr", "flush", "dev", "kube-ipvs0"], "")?;
        for set in ["KUBE-CLUSTER-IP", "KUBE-LOOP-BACK", "KUBE-IPVS-IPS"] {
            ns_run(node, "ipset", &["flush", set], "")?;
        }
        Ok(())
    }
}
