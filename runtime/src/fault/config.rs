//! The `[faults]` table of a config file, and how command-line flags override it.
//!
//! Invariants:
//! - FAULT-5: a config file's `[faults]` table (`specs`, `seed`) gives the plan unless the
//!   command line says otherwise: `--fault` flags replace its specs, `--fault-seed` its seed.

use super::FaultPlan;
use crate::error::{Result, RuntimeError};

/// The `[faults]` table of a `shardline train --config FILE` TOML file (FAULT-5):
///
/// ```toml
/// [faults]
/// specs = ["kill:rank=1:step=3", "delay:link=0-1:ms=5"]
/// seed = 7
/// ```
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsConfig {
    /// Fault specs, as `--fault` takes them.
    #[serde(default)]
    pub specs: Vec<String>,
    /// Seed of every random fault decision, as `--fault-seed`.
    pub seed: Option<u64>,
}

impl FaultsConfig {
    /// Parses the `[faults]` table out of a config file's text (a file without one gives an
    /// empty table).
    pub fn from_toml(text: &str) -> std::result::Result<Self, String> {
        crate::config_file::ConfigFile::from_toml(text).map(|c| c.faults)
    }

    /// Reads `path`; errors name the file.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RuntimeError::config(format!("cannot read --config {}: {e}", path.display()))
        })?;
        Self::from_toml(&text)
            .map_err(|e| RuntimeError::config(format!("--config {}: {e}", path.display())))
    }

    /// The plan: flags override the file (FAULT-5): `--fault` flags, when any is given,
    /// replace the file's specs; `--fault-seed`, when given, replaces its seed; the seed
    /// defaults to 0.
    pub fn plan(
        &self,
        flag_specs: &[String],
        flag_seed: Option<u64>,
    ) -> std::result::Result<FaultPlan, String> {
        let specs = if flag_specs.is_empty() { &self.specs } else { flag_specs };
        FaultPlan::parse(specs, flag_seed.or(self.seed).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{FaultSpec, Phase};

    /// FAULT-5: the `[faults]` table of a TOML file, and flags over file values.
    #[test]
    fn config_file_faults_and_flag_override() {
        let text =
            "[faults]\nspecs = [\"kill:rank=1:step=3\", \"delay:link=0-1:ms=5\"]\nseed = 7\n";
        let c = FaultsConfig::from_toml(text).expect("parses");
        assert_eq!(c.specs, vec!["kill:rank=1:step=3".to_string(), "delay:link=0-1:ms=5".into()]);
        assert_eq!(c.seed, Some(7));
        let p = c.plan(&[], None).expect("plan from the file");
        assert_eq!(p.seed, 7);
        assert_eq!(p.faults[0], FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Forward });
        assert_eq!(p.faults[1].kind(), "delay");
        // Flags replace the file's specs and seed, each on its own.
        let flags = vec!["stall:rank=0:step=2:secs=1".to_string()];
        let p = c.plan(&flags, None).expect("flag specs");
        assert_eq!(p.faults, vec![FaultSpec::Stall { rank: 0, step: 2, secs: 1.0 }]);
        assert_eq!(p.seed, 7);
        let p = c.plan(&[], Some(3)).expect("flag seed");
        assert_eq!((p.faults.len(), p.seed), (2, 3));
        // No table, an empty one, unknown keys, bad specs and bad TOML.
        assert_eq!(FaultsConfig::from_toml("").expect("empty"), FaultsConfig::default());
        assert_eq!(
            FaultsConfig::from_toml("[faults]\n").expect("empty").plan(&[], None).expect("p").seed,
            0
        );
        assert!(FaultsConfig::from_toml("[faults]\nspec = []\n").is_err());
        assert!(FaultsConfig::from_toml("[other]\nx = 1\n").is_err());
        assert!(FaultsConfig::from_toml("[faults]\nseed = \"seven\"\n").is_err());
        assert!(FaultsConfig::from_toml("[faults\n").is_err());
        let bad = FaultsConfig::from_toml("[faults]\nspecs = [\"kill:rank=1\"]\n").expect("toml");
        assert!(bad.plan(&[], None).unwrap_err().contains("missing step="));
        // The file is named in read errors.
        let e = FaultsConfig::load(std::path::Path::new("/nonexistent/faults.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/faults.toml"));
    }
}
