//! Generates the op catalog's Rust and C sides from `src/catalog.toml`, compiles the thin C++
//! dispatcher glue against the torch found in the project's Python (the same way torch-sys
//! does with LIBTORCH_USE_PYTORCH=1) and links it into libtorchfuse.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const PROBE: &str = r#"
import os, torch
root = os.path.dirname(torch.__file__)
print("TORCH_ROOT=" + root)
print("CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
print("VERSION=" + torch.__version__)
"#;

fn main() {
    println!("cargo:rerun-if-changed=src/abi/glue");
    println!("cargo:rerun-if-changed=src/abi/torchfuse_abi.h");
    println!("cargo:rerun-if-changed=src/catalog.toml");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    catalog::generate(Path::new("src/catalog.toml"), &out_dir);
    println!("cargo:rerun-if-env-changed=TORCHFUSE_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let python = std::env::var("TORCHFUSE_PYTHON").unwrap_or_else(|_| {
        if std::env::var_os("VIRTUAL_ENV").is_some() {
            "python".into()
        } else {
            "python3".into()
        }
    });
    let output = Command::new(&python)
        .arg("-c")
        .arg(PROBE)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}; run scripts/setup first"));
    assert!(
        output.status.success(),
        "{python} could not import torch: {}\nrun scripts/setup first",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    let field = |key: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("torch probe did not print {key}: {text}"))
            .to_string()
    };
    let torch_root = PathBuf::from(field("TORCH_ROOT"));
    let version = field("VERSION");
    assert!(
        version.starts_with("2.11.0"),
        "torchfuse is built against torch 2.11.0, found {version}"
    );
    // What `torchfuse doctor` reports and the Python side checks the running torch against.
    println!("cargo:rustc-env=TORCHFUSE_TORCH_VERSION={version}");

    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .opt_level(2)
        .include(&out_dir) // torchfuse_catalog.h
        .include(torch_root.join("include"))
        .include(torch_root.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", field("CXX11_ABI").as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .flag("-fvisibility=hidden")
        .flag("-Wno-unused-parameter")
        .files(glue_sources())
        .compile("torchfuse_glue");

    let lib_dir = torch_root.join("lib");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    for lib in ["torch_cuda", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}

/// The glue's files (src/abi/glue/*.cpp: one per op family, the shared calls, registration),
/// in a stable order.
fn glue_sources() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir("src/abi/glue")
        .expect("src/abi/glue is part of the source tree")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpp"))
        .collect();
    files.sort();
    files
}

/// The op catalog (`src/catalog.toml`): read, checked, and written out as `catalog.rs` (the
/// Rust enums) and `torchfuse_catalog.h` (`TfEntry` and the X-macro the glue registers with).
mod catalog {
    use super::*;

    struct Toggle {
        name: String,
        what: String,
        /// A rewrite of Python code that calls no op of its own: it switches no entry.
        no_op: bool,
        /// An aten override whose gradient autograd makes of other ops (no backward kernel).
        forward_only: bool,
    }

    /// A registry op key (`[[kernel_op]]`).
    struct KernelOp {
        name: String,
        family: String,
        what: String,
    }

    struct Entry {
        id: String,
        op: String,
        toggle: String,
        family: String,
        /// An aten override's dispatch key (`CUDA`, `AutogradCUDA`, or `stub` for a dispatch
        /// stub); empty for torchfuse's own ops, which have `schemas` instead.
        key: String,
        /// The schemas of torchfuse's own ops this entry defines (its op first).
        schemas: Vec<String>,
    }

    /// The dispatch keys an aten override may name, and their C names (`TfKey`).
    const KEYS: [(&str, &str); 3] = [
        ("CUDA", "TF_KEY_CUDA"),
        ("AutogradCUDA", "TF_KEY_AUTOGRAD_CUDA"),
        ("stub", "TF_KEY_STUB"),
    ];

    /// A toggle's optional true/false `key` (false where absent).
    fn flag(table: &toml::Table, key: &str) -> bool {
        match table.get(key) {
            None => false,
            Some(toml::Value::Boolean(b)) => *b,
            Some(other) => panic!(
                "src/catalog.toml: toggle {:?}: `{key}` is true or false, not {other:?}",
                table.get("name")
            ),
        }
    }

    fn field(table: &toml::Table, key: &str, what: &str) -> String {
        match table.get(key) {
            Some(toml::Value::String(s)) if !s.is_empty() => s.clone(),
            _ => panic!("src/catalog.toml: a {what} without a `{key}` string: {table:?}"),
        }
    }

    fn list<'a>(doc: &'a toml::Table, key: &str) -> Vec<&'a toml::Table> {
        match doc.get(key) {
            Some(toml::Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_table()
                        .unwrap_or_else(|| panic!("src/catalog.toml: [[{key}]] holds a non-table"))
                })
                .collect(),
            _ => panic!("src/catalog.toml has no [[{key}]]"),
        }
    }

    /// `layer_norm` -> `LayerNorm`.
    fn camel(snake: &str) -> String {
        snake
            .split('_')
            .map(|w| {
                let mut c = w.chars();
                c.next()
                    .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// `FusedAdamwTensorLr` -> `FUSED_ADAMW_TENSOR_LR`.
    fn caps(camel: &str) -> String {
        let mut out = String::new();
        for (i, ch) in camel.chars().enumerate() {
            if ch.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(ch.to_ascii_uppercase());
        }
        out
    }

    fn read(path: &Path) -> (Vec<Toggle>, Vec<Entry>, Vec<KernelOp>) {
        let text =
            std::fs::read_to_string(path).expect("src/catalog.toml is part of the source tree");
        let doc: toml::Table = text
            .parse()
            .unwrap_or_else(|e| panic!("src/catalog.toml does not parse: {e}"));
        let toggles: Vec<Toggle> = list(&doc, "toggle")
            .into_iter()
            .map(|t| Toggle {
                name: field(t, "name", "toggle"),
                what: field(t, "what", "toggle"),
                no_op: flag(t, "no_op"),
                forward_only: flag(t, "forward_only"),
            })
            .collect();
        let entries: Vec<Entry> = list(&doc, "entry")
            .into_iter()
            .map(|t| {
                let id = field(t, "id", "entry");
                let key = match t.get("key") {
                    None => String::new(),
                    Some(_) => field(t, "key", "entry"),
                };
                let schemas: Vec<String> = match t.get("schemas") {
                    None => Vec::new(),
                    Some(toml::Value::Array(items)) => items
                        .iter()
                        .map(|v| {
                            v.as_str()
                                .unwrap_or_else(|| {
                                    panic!("src/catalog.toml: entry {id}: `schemas` holds a non-string")
                                })
                                .to_string()
                        })
                        .collect(),
                    Some(_) => panic!("src/catalog.toml: entry {id}: `schemas` is not a list"),
                };
                Entry {
                    op: field(t, "op", "entry"),
                    toggle: field(t, "toggle", "entry"),
                    family: field(t, "family", "entry"),
                    id,
                    key,
                    schemas,
                }
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        for name in toggles
            .iter()
            .map(|t| &t.name)
            .chain(entries.iter().map(|e| &e.id))
        {
            assert!(
                seen.insert(name.clone()),
                "src/catalog.toml: `{name}` declared twice"
            );
        }
        // Names that become identifiers must map one to one (CamelCase ids, snake_case toggles
        // and families); text that lands in generated code holds no quote, backslash or control.
        let camel_case = |s: &str| {
            s.starts_with(|c: char| c.is_ascii_uppercase())
                && s.chars().all(|c| c.is_ascii_alphanumeric())
        };
        let snake_case = |s: &str| {
            !s.is_empty()
                && s.split('_').all(|w| {
                    w.starts_with(|c: char| c.is_ascii_lowercase())
                        && w.chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                })
        };
        let plain = |s: &str| !s.chars().any(|c| c.is_control() || c == '"' || c == '\\');
        for t in &toggles {
            assert!(
                snake_case(&t.name) && plain(&t.what),
                "src/catalog.toml: toggle `{}`: a snake_case name, a `what` of plain text",
                t.name
            );
        }
        for e in &entries {
            assert!(
                toggles.iter().any(|t| t.name == e.toggle),
                "src/catalog.toml: entry {} names toggle `{}`, which is not declared",
                e.id,
                e.toggle
            );
            assert!(
                camel_case(&e.id) && snake_case(&e.family) && plain(&e.op),
                "src/catalog.toml: entry {}: id CamelCase, family snake_case, op of plain text",
                e.id
            );
            // torchfuse's own ops are defined from their schemas; aten's are overridden at a key.
            let own = e.op.starts_with("torchfuse::");
            assert!(
                own == e.key.is_empty() && own != e.schemas.is_empty(),
                "src/catalog.toml: entry {}: torchfuse's own op with `schemas`, or an aten \
                 override with a `key`, not both",
                e.id
            );
            assert!(
                e.key.is_empty() || KEYS.iter().any(|(k, _)| *k == e.key),
                "src/catalog.toml: entry {}: key `{}` is not one of {KEYS:?}",
                e.id,
                e.key
            );
            for schema in &e.schemas {
                let name = schema.split('(').next().unwrap_or_default();
                assert!(
                    snake_case(name) && plain(schema) && schema.contains(") -> "),
                    "src/catalog.toml: entry {}: schema `{schema}`: `name(args) -> returns` \
                     of plain text, a snake_case name",
                    e.id
                );
            }
        }
        for t in &toggles {
            let switches = entries.iter().any(|e| e.toggle == t.name);
            assert!(
                switches != t.no_op,
                "src/catalog.toml: toggle `{}`: {}",
                t.name,
                if t.no_op {
                    "`no_op` but an entry names it"
                } else {
                    "switches no entry (`no_op = true` for a rewrite that calls no op)"
                }
            );
        }
        let kernel_ops: Vec<KernelOp> = list(&doc, "kernel_op")
            .into_iter()
            .map(|t| KernelOp {
                name: field(t, "name", "kernel_op"),
                family: field(t, "family", "kernel_op"),
                what: field(t, "what", "kernel_op"),
            })
            .collect();
        let mut seen_ops = std::collections::HashSet::new();
        for k in &kernel_ops {
            assert!(
                snake_case(&k.name) && plain(&k.what) && seen_ops.insert(k.name.clone()),
                "src/catalog.toml: kernel_op `{}`: a snake_case name declared once, a `what` of \
                 plain text",
                k.name
            );
            assert!(
                entries.iter().any(|e| e.family == k.family),
                "src/catalog.toml: kernel_op `{}` names family `{}`, which serves no entry",
                k.name,
                k.family
            );
        }
        (toggles, entries, kernel_ops)
    }

    fn families(entries: &[Entry]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for e in entries {
            if !out.contains(&e.family) {
                out.push(e.family.clone());
            }
        }
        out
    }

    /// `pub fn name(self) -> ret { match self { left => right, ... } }`, with its doc line.
    fn match_fn(r: &mut String, doc: &str, signature: &str, arms: &[(String, String)]) {
        if !doc.is_empty() {
            let _ = writeln!(r, "    /// {doc}");
        }
        let _ = writeln!(r, "    pub fn {signature} {{\n        match self {{");
        for (left, right) in arms {
            let _ = writeln!(r, "            {left} => {right},");
        }
        *r += "        }\n    }\n\n";
    }

    /// `pub const ALL: [ty; n] = [...];`.
    fn all(r: &mut String, ty: &str, variants: &[String]) {
        let _ = writeln!(r, "    pub const ALL: [{ty}; {}] = [", variants.len());
        for v in variants {
            let _ = writeln!(r, "        {ty}::{v},");
        }
        *r += "    ];\n\n";
    }

    /// A user-named enum: each variant with its doc line and attribute lines, then `impl` opened
    /// with `ALL` and `name()` (the snake_case name each variant is generated from); the caller
    /// adds its own functions and closes the `impl`.
    fn named_enum(r: &mut String, ty: &str, derive: &str, variants: &[(&str, String, String)]) {
        *r += derive;
        let _ = writeln!(r, "pub enum {ty} {{");
        for (name, doc, attribute) in variants {
            let _ = writeln!(r, "    /// {doc}\n{attribute}    {},", camel(name));
        }
        let _ = writeln!(r, "}}\n\nimpl {ty} {{");
        let camels: Vec<String> = variants.iter().map(|(name, ..)| camel(name)).collect();
        all(r, ty, &camels);
        let names: Vec<_> = variants
            .iter()
            .map(|(name, ..)| (format!("{ty}::{}", camel(name)), format!("{name:?}")))
            .collect();
        match_fn(r, "", "name(self) -> &'static str", &names);
    }

    fn rust(toggles: &[Toggle], entries: &[Entry]) -> String {
        let derive = "#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]\n";
        let toggle_arm = |t: &Toggle, right: String| (format!("Toggle::{}", camel(&t.name)), right);
        let entry_arm = |e: &Entry, right: String| (format!("Entry::{}", e.id), right);
        let mut r = String::from(
            "// Generated by build.rs from src/catalog.toml: edit that file, not this one.\n\n\
             /// A user-facing toggle name (`TORCHFUSE_OPS`, `torch.ops.torchfuse.set_enabled`).\n",
        );
        let variants: Vec<_> = toggles
            .iter()
            .map(|t| (t.name.as_str(), format!("{}.", t.what), String::new()))
            .collect();
        named_enum(&mut r, "Toggle", derive, &variants);
        let whats: Vec<_> = toggles
            .iter()
            .map(|t| toggle_arm(t, format!("{:?}", t.what)))
            .collect();
        match_fn(
            &mut r,
            "What it covers.",
            "what(self) -> &'static str",
            &whats,
        );
        let arms: Vec<_> = toggles
            .iter()
            .map(|t| toggle_arm(t, t.no_op.to_string()))
            .collect();
        match_fn(
            &mut r,
            "A rewrite that calls no op of its own (it switches no entry).",
            "no_op(self) -> bool",
            &arms,
        );
        let arms: Vec<_> = toggles
            .iter()
            .map(|t| toggle_arm(t, t.forward_only.to_string()))
            .collect();
        match_fn(
            &mut r,
            "An aten override whose gradient autograd makes of other ops: no backward to override.",
            "forward_only(self) -> bool",
            &arms,
        );
        r += "}\n\n/// The op family that serves an entry (`ops::<family>`, the glue's `register_<family>`).\n";
        r += derive;
        r += "pub enum OpFamily {\n";
        for f in families(entries) {
            let _ = writeln!(r, "    {},", camel(&f));
        }
        r += "}\n\n/// One override point: an aten op at a dispatch key, or one of torchfuse's own ops. The\n\
              /// numbering is `TfEntry` of the generated `torchfuse_catalog.h`.\n#[repr(u32)]\n";
        r += derive;
        r += "pub enum Entry {\n";
        for (i, e) in entries.iter().enumerate() {
            let _ = writeln!(r, "    {} = {i},", e.id);
        }
        r += "}\n\nimpl Entry {\n";
        all(
            &mut r,
            "Entry",
            &entries.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        );
        let ops: Vec<_> = entries
            .iter()
            .map(|e| entry_arm(e, format!("{:?}", e.op)))
            .collect();
        let doc = "The op's name (aten's with overload, or `torchfuse::name`) as the logs show it.";
        match_fn(&mut r, doc, "aten_name(self) -> &'static str", &ops);
        let toggles: Vec<_> = entries
            .iter()
            .map(|e| entry_arm(e, format!("Toggle::{}", camel(&e.toggle))))
            .collect();
        match_fn(&mut r, "", "toggle(self) -> Toggle", &toggles);
        let families: Vec<_> = entries
            .iter()
            .map(|e| entry_arm(e, format!("OpFamily::{}", camel(&e.family))))
            .collect();
        match_fn(&mut r, "", "family(self) -> OpFamily", &families);
        r += "}\n";
        r
    }

    fn header(entries: &[Entry]) -> String {
        let mut h = String::from(
            "// Generated by build.rs from src/catalog.toml: edit that file, not this one.\n\
             #ifndef TORCHFUSE_CATALOG_H\n#define TORCHFUSE_CATALOG_H\n\n\
             // The override points, numbered as src/catalog.toml lists them.\nenum TfEntry {\n",
        );
        for (i, e) in entries.iter().enumerate() {
            let _ = writeln!(h, "  TF_ENTRY_{} = {i},", caps(&e.id));
        }
        let _ = writeln!(h, "  TF_ENTRY_COUNT = {}\n}};\n", entries.len());
        h += "// Where an entry registers: an aten override's dispatch key, a dispatch stub, or\n\
              // torchfuse's own op (defined from its schemas).\nenum TfKey {\n";
        for (_, c) in KEYS {
            let _ = writeln!(h, "  {c},");
        }
        h += "  TF_KEY_OWN\n};\n\n";
        h += "// X(ID, op name as logged, family, key): every entry, in TfEntry order.\n#define TF_FOR_EACH_ENTRY(X)";
        for e in entries {
            let key = KEYS
                .iter()
                .find(|(k, _)| *k == e.key)
                .map_or("TF_KEY_OWN", |(_, c)| c);
            let _ = write!(
                h,
                " \\\n  X({}, \"{}\", {}, {key})",
                caps(&e.id),
                e.op,
                e.family
            );
        }
        h += "\n\n// X(family): every op family, in the catalog's order.\n#define TF_FOR_EACH_FAMILY(X)";
        for f in families(entries) {
            let _ = write!(h, " X({f})");
        }
        h += "\n\n// X(ID, schema): every schema of torchfuse's own ops, by the entry that defines it.\n\
              #define TF_FOR_EACH_SCHEMA(X)";
        for e in entries {
            for schema in &e.schemas {
                let _ = write!(h, " \\\n  X({}, \"{schema}\")", caps(&e.id));
            }
        }
        h += "\n\n#endif  // TORCHFUSE_CATALOG_H\n";
        h
    }

    /// Writes a generated file only when its text changed (no rebuild of the glue otherwise).
    fn write(path: PathBuf, text: String) {
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, text)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        }
    }

    /// The registry's op keys: `KernelOp` (deserialized from the registry's `op`), its names and
    /// the family of each (src/ops/mod.rs includes it).
    fn kernel_ops_rust(ops: &[KernelOp]) -> String {
        let arm = |k: &KernelOp, right: String| (format!("KernelOp::{}", camel(&k.name)), right);
        let mut r = String::from(
            "// Generated by build.rs from src/catalog.toml: edit that file, not this one.\n\n\
             /// A kernel operation the registry knows variants of (`op` in registry/*.toml).\n",
        );
        let variants: Vec<_> = ops
            .iter()
            .map(|k| {
                let rename = format!("    #[serde(rename = \"{}\")]\n", k.name);
                (k.name.as_str(), k.what.clone(), rename)
            })
            .collect();
        let derive =
            "#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]\n";
        named_enum(&mut r, "KernelOp", derive, &variants);
        let families: Vec<_> = ops
            .iter()
            .map(|k| arm(k, format!("OpFamily::{}", camel(&k.family))))
            .collect();
        match_fn(
            &mut r,
            "The family that launches it and reads its variants' params.",
            "family(self) -> OpFamily",
            &families,
        );
        r += "}\n";
        r
    }

    pub fn generate(path: &Path, out_dir: &Path) {
        let (toggles, entries, kernel_ops) = read(path);
        write(out_dir.join("catalog.rs"), rust(&toggles, &entries));
        write(out_dir.join("kernel_ops.rs"), kernel_ops_rust(&kernel_ops));
        write(out_dir.join("torchfuse_catalog.h"), header(&entries));
    }
}
