//! Process-wide state: the config read from the environment, logging, the per-call stats and
//! the op toggles. Depends only on `select` (for stock reasons).

pub mod config;
pub mod logging;
pub mod stats;
pub mod toggles;

pub use config::Config;
pub use toggles::{Entry, OpFamily, Toggle};
