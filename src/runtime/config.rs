//! Process configuration from the environment (the variables in README.md). Bad values never
//! stop the job: each produces one warning naming the valid values, and the default is used.
//! The process's config is read once, on first use (`get`).

use super::toggles::Toggle;
use once_cell::sync::OnceCell;
use std::path::PathBuf;

static CONFIG: OnceCell<Config> = OnceCell::new();

/// The process's config, read from the environment the first time it is asked for.
pub fn get() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `TORCHFUSE=0`: load, register nothing.
    pub active: bool,
    /// Toggles enabled by `TORCHFUSE_OPS`, indexed by `Toggle::index`.
    pub ops: [bool; Toggle::ALL.len()],
    pub log_filter: String,
    /// `TORCHFUSE_LOG_FILE`, its `{rank}` replaced by this process's rank.
    pub log_file: Option<PathBuf>,
    /// `TORCHFUSE_STATS_DIR`: where the process writes its calls' stats at exit.
    pub stats_dir: Option<PathBuf>,
    /// `RANK` (torchrun sets it in every rank's environment, not in its own).
    pub rank: Option<String>,
    pub cache_dir: PathBuf,
    /// Problems found while parsing, logged once logging is up.
    pub warnings: Vec<String>,
}

pub const DEFAULT_LOG_FILTER: &str = "warn";

impl Config {
    pub fn from_env() -> Config {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parses from any variable lookup, so tests need not touch the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Config {
        let mut warnings = Vec::new();

        // The spellings Python users give a switch, in any case.
        let active = match get("TORCHFUSE").map(|v| v.trim().to_ascii_lowercase()) {
            None => true,
            Some(v) if matches!(v.as_str(), "" | "1" | "true" | "yes" | "on") => true,
            Some(v) if matches!(v.as_str(), "0" | "false" | "no" | "off") => false,
            Some(other) => {
                warnings.push(format!(
                    "TORCHFUSE={other:?} is not valid (use 1, true, yes or on; 0, false, no or \
                     off); using 1"
                ));
                true
            }
        };

        let ops = parse_ops(get("TORCHFUSE_OPS").as_deref(), &mut warnings);

        let log_filter = match get("TORCHFUSE_LOG") {
            Some(f) if !f.trim().is_empty() => log_filter(f.trim()).unwrap_or_else(|| {
                warnings.push(format!(
                    "TORCHFUSE_LOG={:?} is not a valid filter (use error, warn, info, debug, \
                     trace or target=level); using {DEFAULT_LOG_FILTER}",
                    f.trim()
                ));
                DEFAULT_LOG_FILTER.to_string()
            }),
            _ => DEFAULT_LOG_FILTER.to_string(),
        };

        let rank = get("RANK")
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty());
        // A process without a rank is a job's only one: rank 0.
        let log_file = get("TORCHFUSE_LOG_FILE")
            .filter(|s| !s.trim().is_empty())
            .map(|f| PathBuf::from(f.replace("{rank}", rank.as_deref().unwrap_or("0"))));
        let stats_dir = get("TORCHFUSE_STATS_DIR")
            .filter(|s| !s.trim().is_empty())
            .map(PathBuf::from);

        let cache_dir = get("TORCHFUSE_CACHE_DIR")
            .filter(|s| !s.trim().is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                get("XDG_CACHE_HOME")
                    .filter(|s| !s.is_empty())
                    .map(|x| PathBuf::from(x).join("torchfuse"))
            })
            .or_else(|| {
                get("HOME")
                    .filter(|s| !s.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache").join("torchfuse"))
            })
            .unwrap_or_else(|| std::env::temp_dir().join("torchfuse-cache"));

        Config {
            active,
            ops,
            log_filter,
            log_file,
            stats_dir,
            rank,
            cache_dir,
            warnings,
        }
    }

    pub fn op_enabled(&self, t: Toggle) -> bool {
        self.active && self.ops[t.index()]
    }
}

/// A tracing filter from `TORCHFUSE_LOG`, with Python's level names taken as tracing's
/// (`warning`, `WARNING`, `critical`); None where it is not one. A bare word that is no level
/// is refused: tracing would read it as a target, which silences torchfuse's own messages,
/// the warning about this very setting included.
fn log_filter(value: &str) -> Option<String> {
    let level = |word: &str| -> Option<&'static str> {
        Some(match word.trim().to_ascii_lowercase().as_str() {
            "trace" => "trace",
            "debug" => "debug",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "critical" | "fatal" => "error",
            "off" => "off",
            _ => return None,
        })
    };
    let directives: Option<Vec<String>> = value
        .split(',')
        .map(|directive| match directive.rsplit_once('=') {
            Some((target, word)) => Some(format!("{target}={}", level(word)?)),
            None => level(directive).map(str::to_string),
        })
        .collect();
    let filter = directives?.join(",");
    tracing_subscriber::EnvFilter::try_new(&filter)
        .is_ok()
        .then_some(filter)
}

fn valid_names() -> String {
    format!("all, none, {}", Toggle::names())
}

/// `all`, `none`, a comma list (`layer_norm,adam`), or removals (`-sdpa`), applied left to
/// right; a list that starts with a removal starts from `all`. Names in any case. A list with an
/// unknown name is not used at all (a typo must not switch every other op off): one warning
/// names the unknown ones and the valid ones, and `all` holds, the default.
fn parse_ops(value: Option<&str>, warnings: &mut Vec<String>) -> [bool; Toggle::ALL.len()] {
    let all = [true; Toggle::ALL.len()];
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return all;
    };
    let tokens: Vec<String> = value
        .split(',')
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let mut ops = if tokens.first().is_some_and(|t| t.starts_with('-')) {
        all
    } else {
        [false; Toggle::ALL.len()]
    };
    let mut unknown = Vec::new();
    for token in &tokens {
        let (remove, name) = match token.strip_prefix('-') {
            Some(rest) => (true, rest.trim()),
            None => (false, token.as_str()),
        };
        match (name, Toggle::from_name(name)) {
            ("all", _) => {
                ops = if remove {
                    [false; Toggle::ALL.len()]
                } else {
                    all
                }
            }
            ("none", _) => {
                ops = if remove {
                    all
                } else {
                    [false; Toggle::ALL.len()]
                }
            }
            (_, Some(t)) => ops[t.index()] = !remove,
            (_, None) => unknown.push(format!("{name:?}")),
        }
    }
    if unknown.is_empty() {
        return ops;
    }
    warnings.push(format!(
        "TORCHFUSE_OPS={value:?}: unknown op {} (valid: {}); using all",
        unknown.join(", "),
        valid_names()
    ));
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    fn enabled(c: &Config) -> Vec<&'static str> {
        Toggle::ALL
            .into_iter()
            .filter(|t| c.op_enabled(*t))
            .map(Toggle::name)
            .collect()
    }

    #[test]
    fn defaults_enable_everything_quietly() {
        let c = cfg(&[("HOME", "/home/u")]);
        assert!(c.active);
        assert_eq!(enabled(&c).len(), Toggle::ALL.len());
        assert_eq!(c.log_filter, "warn");
        assert_eq!(c.log_file, None);
        assert_eq!(c.cache_dir, PathBuf::from("/home/u/.cache/torchfuse"));
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn torchfuse_zero_disables_all_ops() {
        let c = cfg(&[("TORCHFUSE", "0"), ("TORCHFUSE_OPS", "layer_norm")]);
        assert!(!c.active);
        assert!(enabled(&c).is_empty());
    }

    #[test]
    fn bad_master_switch_warns_and_stays_on() {
        let c = cfg(&[("TORCHFUSE", "maybe")]);
        assert!(c.active);
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].contains("\"maybe\" is not valid"));
        assert!(c.warnings[0].contains("0, false, no or off"));
    }

    #[test]
    fn the_master_switch_takes_pythons_spellings() {
        for off in ["0", "false", "False", "NO", "off", " Off "] {
            let c = cfg(&[("TORCHFUSE", off)]);
            assert!(!c.active && c.warnings.is_empty(), "{off:?}");
        }
        for on in ["1", "true", "TRUE", "yes", "on", ""] {
            let c = cfg(&[("TORCHFUSE", on)]);
            assert!(c.active && c.warnings.is_empty(), "{on:?}");
        }
    }

    #[test]
    fn op_lists_and_removals() {
        assert_eq!(
            enabled(&cfg(&[("TORCHFUSE_OPS", "layer_norm, adam")])),
            vec!["layer_norm", "adam"]
        );
        // Removals: every toggle of the catalog but the removed ones, in its order.
        let all_but = |removed: &[&str]| -> Vec<&'static str> {
            Toggle::ALL
                .iter()
                .map(|t| t.name())
                .filter(|name| !removed.contains(name))
                .collect()
        };
        let defaults = all_but(&[]).len();
        assert_eq!(
            enabled(&cfg(&[("TORCHFUSE_OPS", "-sdpa")])),
            all_but(&["sdpa"])
        );
        assert_eq!(
            enabled(&cfg(&[("TORCHFUSE_OPS", "-sdpa,-adam,-gelu_tanh")])),
            all_but(&["sdpa", "adam", "gelu_tanh"])
        );
        assert_eq!(
            enabled(&cfg(&[("TORCHFUSE_OPS", "all,-embedding")])),
            all_but(&["embedding"])
        );
        assert_eq!(all_but(&["sdpa"]).len(), defaults - 1);
        assert_eq!(
            enabled(&cfg(&[("TORCHFUSE_OPS", "hf_rms_norm,rms_norm")])),
            vec!["rms_norm", "hf_rms_norm"]
        );
        assert!(enabled(&cfg(&[("TORCHFUSE_OPS", "none")])).is_empty());
        assert_eq!(enabled(&cfg(&[("TORCHFUSE_OPS", "")])).len(), defaults);
    }

    #[test]
    fn unknown_op_names_warn_with_the_valid_ones_and_keep_the_default() {
        for value in ["layer_norm,attention", "layernorm", "-sdpa,bogus"] {
            let c = cfg(&[("TORCHFUSE_OPS", value)]);
            assert_eq!(enabled(&c).len(), Toggle::ALL.len(), "{value}");
            assert_eq!(c.warnings.len(), 1, "{value}");
            assert!(c.warnings[0].contains("rms_norm, embedding, adam, sdpa"));
            assert!(c.warnings[0].contains("using all"));
        }
        let c = cfg(&[("TORCHFUSE_OPS", "layer_norm,attention,bogus")]);
        assert!(c.warnings[0].contains("unknown op \"attention\", \"bogus\""));
    }

    #[test]
    fn op_names_in_any_case() {
        let c = cfg(&[("TORCHFUSE_OPS", "Layer_Norm,ADAM")]);
        assert_eq!(enabled(&c), vec!["layer_norm", "adam"]);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn log_settings() {
        let c = cfg(&[
            ("TORCHFUSE_LOG", "torchfuse=trace"),
            ("TORCHFUSE_LOG_FILE", "/tmp/tf.log"),
        ]);
        assert_eq!(c.log_filter, "torchfuse=trace");
        assert_eq!(c.log_file, Some(PathBuf::from("/tmp/tf.log")));
        let bad = cfg(&[("TORCHFUSE_LOG", "torchfuse=loud")]);
        assert_eq!(bad.log_filter, "warn");
        assert_eq!(bad.warnings.len(), 1);
    }

    #[test]
    fn log_levels_take_pythons_names_and_refuse_bare_targets() {
        for (value, filter) in [
            ("warning", "warn"),
            ("WARNING", "warn"),
            ("Info", "info"),
            ("critical", "error"),
            ("torchfuse=warning,info", "torchfuse=warn,info"),
        ] {
            let c = cfg(&[("TORCHFUSE_LOG", value)]);
            assert_eq!(
                (c.log_filter.as_str(), c.warnings.len()),
                (filter, 0),
                "{value}"
            );
        }
        // tracing would read a bare word as a target and silence torchfuse's own messages.
        for value in ["verbose", "torchfuse", "info,chatty"] {
            let c = cfg(&[("TORCHFUSE_LOG", value)]);
            assert_eq!(c.log_filter, "warn", "{value}");
            assert_eq!(c.warnings.len(), 1, "{value}");
        }
    }

    #[test]
    fn each_rank_its_own_log_file() {
        let per_rank = [("TORCHFUSE_LOG_FILE", "/tmp/tf-{rank}.log"), ("RANK", "3")];
        assert_eq!(
            cfg(&per_rank).log_file,
            Some(PathBuf::from("/tmp/tf-3.log"))
        );
        assert_eq!(cfg(&per_rank).rank.as_deref(), Some("3"));
        let no_rank = cfg(&[("TORCHFUSE_LOG_FILE", "/tmp/tf-{rank}.log")]);
        assert_eq!(no_rank.log_file, Some(PathBuf::from("/tmp/tf-0.log")));
        assert_eq!(
            cfg(&[("TORCHFUSE_STATS_DIR", "/s")]).stats_dir,
            Some(PathBuf::from("/s"))
        );
        assert_eq!(cfg(&[]).stats_dir, None);
    }

    #[test]
    fn cache_dir_precedence() {
        let c = cfg(&[
            ("TORCHFUSE_CACHE_DIR", "/c"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(c.cache_dir, PathBuf::from("/c"));
        let c = cfg(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(c.cache_dir, PathBuf::from("/x/torchfuse"));
    }
}
