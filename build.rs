//! Builds `kernels-gpu/` to PTX twice and hands both modules to the host crate (embedded
//! with `include_str!` in `host/gpu/module.rs`, which loads the one the device runs):
//! - `layernorm_kernels.ptx`, sm_80: every GPU from the A100 on;
//! - `layernorm_kernels_sm90.ptx`, sm_90 (Hopper) with `--cfg layernorm_sm90`: the same
//!   kernels plus those that use thread-block clusters.
//!
//! The kernel toolchain (a rustc that can build `core` for `nvptx64-nvidia-cuda`) is looked
//! for in this order:
//!   1. `LAYERNORM_KERNEL_CARGO` and `LAYERNORM_KERNEL_RUSTC`: an explicit cargo/rustc pair;
//!   2. Debian's `rustc-web` + `cargo-web` + `rust-web-src` (/usr/bin/rustc, /usr/bin/cargo,
//!      /usr/lib/rustlib/src/rust/library);
//!   3. a rustup `nightly` toolchain with the `rust-src` component.
//!
//! Where none exists, where the one found fails (a `cargo:warning` says how), or with
//! `LAYERNORM_KERNEL_PTX=checked-in`, the PTX checked in beside the kernel crate
//! (`kernels-gpu/*.ptx`) is used. Each file's first line records the SHA-256 of what it was
//! built from (the kernel sources and this file); if that has changed since, the build fails
//! rather than ship kernels that do not match it. `LAYERNORM_KERNEL_PTX=update` writes the
//! freshly built PTX back to those files (run it after changing a kernel or this file), and
//! fails where it cannot build them. Any other value of `LAYERNORM_KERNEL_PTX`, or only one
//! of `LAYERNORM_KERNEL_CARGO` and `LAYERNORM_KERNEL_RUSTC`, stops the build.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

// The kernel registry, the same file the host compiles (through the layout module): the
// launch bounds and cluster sizes written into the PTX here. The host uses the rest of it.
#[allow(dead_code)]
#[path = "kernels-gpu/layout/registry.rs"]
mod registry;
use registry::{Arch, KernelName, Norm, TypePair, Variant};

const KERNEL_DIR: &str = "kernels-gpu";
/// The module of numbers the kernels and the host share, inside the kernel folder.
const LAYOUT_DIR: &str = "layout";

/// The kernel crate's manifest, which this build writes to `$OUT_DIR/kernel-crate/` with the
/// root of its sources (`@SRC@`: `kernels-gpu/src/lib.rs`). It lives here, not as
/// `kernels-gpu/Cargo.toml`: cargo leaves every folder with a manifest of its own out of this
/// crate's package, which must carry the kernel sources.
const KERNEL_MANIFEST: &str = r#"[package]
name = "layernorm-kernels-gpu"
version = "0.1.0"
edition = "2024"
publish = false

# Built only for nvptx64-nvidia-cuda by the host crate's build.rs; never part of a workspace.
[workspace]

[lib]
path = "@SRC@"
crate-type = ["rlib"]

[profile.release]
opt-level = 3
codegen-units = 1
panic = "abort"
debug = false

[profile.dev]
panic = "abort"

# As the host's [workspace.lints]: every unsafe operation sits in an `unsafe` block, and
# every block says why it is sound. CI (`.ci/run`) runs clippy on this crate with -D warnings.
[lints.rust]
# build.rs passes `--cfg layernorm_sm90` for the Hopper module.
unexpected_cfgs = { level = "warn", check-cfg = ["cfg(layernorm_sm90)"] }
unsafe_op_in_unsafe_fn = "warn"

[lints.clippy]
undocumented_unsafe_blocks = "warn"
"#;
const HASH_PREFIX: &str = "// layernorm-cuda kernel sources sha256: ";
const INSTALL: &str = "Install a kernel toolchain (Debian: `apt-get install rustc-web cargo-web \
     rust-web-src`; rustup: `rustup toolchain install nightly --component rust-src`), or set \
     LAYERNORM_KERNEL_CARGO and LAYERNORM_KERNEL_RUSTC to a cargo/rustc pair that can build \
     `core` for nvptx64-nvidia-cuda";

/// What `LAYERNORM_KERNEL_PTX` asks for.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Unset: build the PTX where a kernel toolchain works, else use the checked-in files.
    Build,
    /// `checked-in`: use the checked-in files without looking for a toolchain.
    CheckedIn,
    /// `update`: build the PTX and write it over the checked-in files.
    Update,
}

/// One PTX module: its file name (in `$OUT_DIR` and, checked in, in `kernels-gpu/`), the
/// GPU it targets, the extra rustc flags of its build, and its column of the kernel registry.
struct Module {
    file: &'static str,
    target_cpu: &'static str,
    flags: &'static [&'static str],
    arch: Arch,
}

const MODULES: &[Module] = &[
    // sm_80 (A100) and later, Hopper included through the driver's JIT.
    Module {
        file: "layernorm_kernels.ptx",
        target_cpu: "sm_80",
        flags: &[],
        arch: Arch::Sm80,
    },
    // Hopper: clusters and distributed shared memory exist from sm_90 on. PTX 8.1 for the
    // clusters' exchange (`st.async`, `mbarrier.arrive.expect_tx`): a driver of CUDA 12.1 or
    // later loads it (host/gpu/module.rs takes the sm_80 module under an older one).
    Module {
        file: "layernorm_kernels_sm90.ptx",
        target_cpu: "sm_90",
        flags: &["--cfg", "layernorm_sm90", "-C", "target-feature=+ptx81"],
        arch: Arch::Sm90,
    },
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={KERNEL_DIR}/src");
    println!("cargo:rerun-if-changed={KERNEL_DIR}/{LAYOUT_DIR}");
    for m in MODULES {
        println!("cargo:rerun-if-changed={KERNEL_DIR}/{}", m.file);
    }
    for var in [
        "LAYERNORM_KERNEL_CARGO",
        "LAYERNORM_KERNEL_RUSTC",
        "LAYERNORM_KERNEL_PTX",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // Settings first: a misspelt one must stop the build, not be silently ignored.
    let mode = match setting("LAYERNORM_KERNEL_PTX") {
        None => Mode::Build,
        Some(v) if v == "checked-in" => Mode::CheckedIn,
        Some(v) if v == "update" => Mode::Update,
        Some(v) => panic!(
            "LAYERNORM_KERNEL_PTX={:?} is not a mode this build knows. Accepted: unset or empty \
             (build the PTX where a kernel toolchain works, else use the checked-in files), \
             `checked-in` (use the checked-in files), `update` (build the PTX and write it \
             over the checked-in files).",
            v.to_string_lossy()
        ),
    };
    let explicit = match (
        setting("LAYERNORM_KERNEL_CARGO"),
        setting("LAYERNORM_KERNEL_RUSTC"),
    ) {
        (Some(cargo), Some(rustc)) => Some((PathBuf::from(cargo), PathBuf::from(rustc))),
        (None, None) => None,
        (cargo, _) => panic!(
            "only {} is set: LAYERNORM_KERNEL_CARGO and LAYERNORM_KERNEL_RUSTC name a \
             cargo/rustc pair for the kernel build; set both, or neither to let the build look \
             for a kernel toolchain",
            if cargo.is_some() {
                "LAYERNORM_KERNEL_CARGO"
            } else {
                "LAYERNORM_KERNEL_RUSTC"
            }
        ),
    };

    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernel_dir = root.join(KERNEL_DIR);
    let hash = source_hash(&root);
    let manifest = write_kernel_manifest(&kernel_dir, &out);

    let toolchain = match mode {
        Mode::CheckedIn => None,
        Mode::Build | Mode::Update => find_toolchain(explicit),
    };
    if mode == Mode::Update && toolchain.is_none() {
        panic!(
            "LAYERNORM_KERNEL_PTX=update rebuilds the checked-in PTX, but no kernel toolchain was found. {INSTALL}."
        );
    }
    for m in MODULES {
        let checked_in = kernel_dir.join(m.file);
        let ptx = match toolchain.as_ref().map(|tc| build_ptx(tc, m, &manifest, &out)) {
            Some(Ok(body)) => format!("{HASH_PREFIX}{hash}\n{body}"),
            Some(Err(why)) if mode == Mode::Update => {
                panic!("LAYERNORM_KERNEL_PTX=update: building {} failed: {why}", m.file)
            }
            // A user's build needs working PTX, not this toolchain: the checked-in file
            // serves wherever it matches the sources.
            Some(Err(why)) => {
                for line in why.lines() {
                    println!("cargo:warning={line}");
                }
                println!(
                    "cargo:warning=building {} with the kernel toolchain failed; using the checked-in {}",
                    m.file,
                    checked_in.display()
                );
                checked_in_ptx(
                    &checked_in,
                    &hash,
                    "the kernel toolchain found failed to rebuild it (see the warnings)",
                )
            }
            None if mode == Mode::CheckedIn => checked_in_ptx(
                &checked_in,
                &hash,
                "LAYERNORM_KERNEL_PTX=checked-in forbids rebuilding it (unset it to rebuild)",
            ),
            None => checked_in_ptx(&checked_in, &hash, "no kernel toolchain was found to rebuild it"),
        };
        fs::write(out.join(m.file), ptx).expect("write PTX to OUT_DIR");
    }
    // Only once every module has built, so that a failure leaves the checked-in files as
    // they were, not half of them updated.
    if mode == Mode::Update {
        for m in MODULES {
            let checked_in = kernel_dir.join(m.file);
            fs::copy(out.join(m.file), &checked_in).expect("write the checked-in PTX");
            println!(
                "cargo:warning=updated {} from the kernel sources",
                checked_in.display()
            );
        }
    }
}

/// An environment variable's value; unset and empty are the same.
fn setting(name: &str) -> Option<OsString> {
    env::var_os(name).filter(|v| !v.is_empty())
}

/// A cargo/rustc pair that can build `core` for nvptx64, and how to run it.
struct Toolchain {
    cargo: PathBuf,
    rustc: Option<PathBuf>,
    /// `+nightly` for rustup's proxy.
    channel_arg: Option<&'static str>,
    /// Keep RUSTUP_HOME/CARGO_HOME (rustup's proxies need them).
    keep_rustup_env: bool,
}

/// The `explicit` pair if given, else the first toolchain found (see the file's header).
fn find_toolchain(explicit: Option<(PathBuf, PathBuf)>) -> Option<Toolchain> {
    if let Some((cargo, rustc)) = explicit {
        return Some(Toolchain {
            cargo,
            rustc: Some(rustc),
            channel_arg: None,
            keep_rustup_env: true,
        });
    }
    let debian = Path::new("/usr/lib/rustlib/src/rust/library");
    if debian.is_dir() && Path::new("/usr/bin/rustc").is_file() && Path::new("/usr/bin/cargo").is_file() {
        return Some(Toolchain {
            cargo: "/usr/bin/cargo".into(),
            rustc: Some("/usr/bin/rustc".into()),
            channel_arg: None,
            keep_rustup_env: false,
        });
    }
    let sysroot = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()?;
    let sysroot = PathBuf::from(String::from_utf8(sysroot.stdout).ok()?.trim());
    if sysroot.join("lib/rustlib/src/rust/library").is_dir() {
        return Some(Toolchain {
            cargo: "cargo".into(),
            rustc: None,
            channel_arg: Some("+nightly"),
            keep_rustup_env: true,
        });
    }
    None
}

/// Runs the nested cargo and returns the PTX text, or what went wrong (several lines where
/// the nested build printed errors).
/// Writes the kernel crate's manifest (`KERNEL_MANIFEST`, pointing at the sources in
/// `kernel_dir`) to `out/kernel-crate/Cargo.toml` and returns its path; CI lints the crate
/// through it.
fn write_kernel_manifest(kernel_dir: &Path, out: &Path) -> PathBuf {
    let dir = out.join("kernel-crate");
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let src = kernel_dir.join("src").join("lib.rs");
    // A TOML basic string: backslashes (Windows paths) and quotes escaped.
    let src = src.to_string_lossy().replace('\\', "\\\\").replace('"', "\\\"");
    let path = dir.join("Cargo.toml");
    let text = KERNEL_MANIFEST.replace("@SRC@", &src);
    if fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    path
}

fn build_ptx(tc: &Toolchain, module: &Module, manifest: &Path, out: &Path) -> Result<String, String> {
    // A target dir per module: cargo does not count `cargo rustc`'s extra flags as a change,
    // so with one dir the second module's build would be skipped as fresh and read back
    // the first module's PTX.
    let target_dir = out.join(format!("kernels-target-{}", module.target_cpu));
    let mut cmd = Command::new(&tc.cargo);
    // The outer build's CARGO*/RUST* variables (its rustc, its flags, its lock) must not
    // leak into the nested one: a stable rustc meeting nightly library sources fails.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let rustup = key == "RUSTUP_HOME" || key == "CARGO_HOME" || key == "RUSTUP_TOOLCHAIN";
        if (key.starts_with("CARGO") || key.starts_with("RUST")) && !(tc.keep_rustup_env && rustup) {
            cmd.env_remove(&key);
        }
    }
    if tc.keep_rustup_env {
        cmd.env_remove("RUSTUP_TOOLCHAIN");
    }
    if let Some(arg) = tc.channel_arg {
        cmd.arg(arg);
    }
    if let Some(rustc) = &tc.rustc {
        cmd.env("RUSTC", rustc);
    }
    cmd.env("RUSTC_BOOTSTRAP", "1")
        .args(["rustc", "--manifest-path"])
        .arg(manifest)
        .args([
            "--release",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
            "--target-dir",
        ])
        .arg(&target_dir)
        .args([
            "--",
            "--emit=asm",
            "-C",
            &format!("target-cpu={}", module.target_cpu),
            // Every helper inlined into its kernel, whatever LLVM's cost model says: with
            // twice the kernels sharing each helper it left a row loop's closure as a
            // called function in the f16 locked kernels, which ran 3x slower (docs/PERF.md,
            // v18). `.ci/run` refuses a kernel that calls a function. Calls in blocks that
            // LLVM guesses cold (below 2% of the entry's frequency, behind nested branches,
            // without a profile) have a threshold of their own, 45 by default.
            "-C",
            "llvm-args=-inline-threshold=100000",
            "-C",
            "llvm-args=-inline-cold-callsite-threshold=100000",
        ])
        .args(module.flags);
    let cargo = tc.cargo.display();
    // Captured, not inherited: where a fallback follows, cargo would not show the nested
    // build's errors, so they go into the warning.
    let output = cmd.output().map_err(|e| format!("could not run {cargo}: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let errors: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        return Err(format!(
            "{cargo} building {} for {} failed ({}){}{}",
            manifest.display(),
            module.target_cpu,
            output.status,
            if errors.is_empty() { "" } else { ":\n" },
            errors[errors.len().saturating_sub(20)..].join("\n")
        ));
    }
    // rustc names the asm output `<crate>-<hash>.s`; the newest one is this build's.
    let deps = target_dir.join("nvptx64-nvidia-cuda/release/deps");
    let newest = fs::read_dir(&deps)
        .map_err(|e| format!("{cargo} wrote no {}: {e}", deps.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "s"))
        .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
        .ok_or_else(|| format!("{cargo} wrote no .s file in {}", deps.display()))?;
    let ptx = fs::read_to_string(&newest).map_err(|e| format!("read {}: {e}", newest.display()))?;
    // Only this crate's code is in the PTX: a call into `core` (a panic on an unguarded
    // division, say) stays an unresolved `.extern .func`, and the driver refuses the module.
    if let Some(line) = ptx.lines().find(|l| l.starts_with(".extern .func")) {
        return Err(format!(
            "the kernel PTX calls a function it does not contain ({line}); remove the code path that needs it"
        ));
    }
    Ok(with_launch_bounds(&ptx, module.arch))
}

/// Adds each kernel's launch bound, and to each cluster kernel its cluster size, after its
/// parameter list, where PTX wants them, as the kernel registry gives them for `arch`'s
/// module (with `.reqnctapercluster` a plain launch forms the clusters: no extended launch
/// API needed). A kernel the registry does not know, or a registry kernel the module lacks,
/// stops the build: the table is the one list of kernels.
fn with_launch_bounds(ptx: &str, arch: Arch) -> String {
    let mut expected: Vec<(String, Norm, Variant, TypePair)> = registry::kernels(arch)
        .map(|(norm, v, pair)| (KernelName(norm, v, pair).to_string(), norm, v, pair))
        .collect();
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut directives = Vec::new();
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            let name = entry.split('(').next().unwrap_or(entry);
            let at = expected
                .iter()
                .position(|(n, _, _, _)| n == name)
                .unwrap_or_else(|| panic!("kernel {name} is not in kernels-gpu/layout/registry.rs"));
            let (_, norm, variant, pair) = expected.swap_remove(at);
            directives.clear();
            directives.push(format!(".maxntid {}, 1, 1", variant.max_threads(arch, pair)));
            if let Some(registers) = variant.max_registers(arch, norm, pair) {
                directives.push(format!(".maxnreg {registers}"));
            }
            if variant.one_block_per_sm() {
                directives.push(".minnctapersm 1".to_string());
            }
            if variant.cluster() > 1 {
                directives.push(format!(".reqnctapercluster {}, 1, 1", variant.cluster()));
            }
        } else if line.trim() == ")" {
            for d in directives.drain(..) {
                out.push_str(&d);
                out.push('\n');
            }
        }
    }
    let missing: Vec<&str> = expected.iter().map(|(n, _, _, _)| n.as_str()).collect();
    assert!(
        missing.is_empty(),
        "the registry's kernels {missing:?} are not in the {arch:?} module"
    );
    out
}

/// The checked-in PTX, refused if what it is built from changed since; `why_not_built` says
/// why it is not rebuilt here.
fn checked_in_ptx(path: &Path, hash: &str, why_not_built: &str) -> String {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("{why_not_built}, and {}: {e}", path.display()));
    let recorded = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix(HASH_PREFIX))
        .unwrap_or("");
    if recorded != hash {
        panic!(
            "{} was built from other kernel sources (kernels-gpu/ and build.rs; recorded \
             {recorded}, now {hash}), and {why_not_built}. {INSTALL}; then rebuild, and \
             refresh the checked-in files with LAYERNORM_KERNEL_PTX=update.",
            path.display()
        );
    }
    text
}

/// SHA-256 over everything that shapes the PTX (relative path and contents of each file, in
/// path order): the kernel crate's sources, those of the layout module it shares with the
/// host (`kernels-gpu/layout`, whose registry holds the launch bounds and cluster sizes),
/// and all of this file (with the kernel crate's manifest). This file holds the module list, target cpus and
/// flags, how the registry's directives are written, and the nested build's command line;
/// hashing the whole of it leaves out nothing that code here adds to the PTX now or later.
/// The price: any edit of this file, a comment's included, needs the checked-in PTX's hash
/// line refreshed (`LAYERNORM_KERNEL_PTX=update`).
fn source_hash(root: &Path) -> String {
    let kernel_dir = root.join(KERNEL_DIR);
    let layout_dir = kernel_dir.join(LAYOUT_DIR);
    let mut files = vec![root.join("build.rs")];
    collect_rs(&kernel_dir.join("src"), &mut files);
    collect_rs(&layout_dir, &mut files);
    files.sort();
    let mut h = Sha256::new();
    for f in &files {
        let rel = f.strip_prefix(root).expect("under the crate's root");
        h.update(rel.to_string_lossy().as_bytes());
        h.update([0]);
        h.update(fs::read(f).unwrap_or_else(|e| panic!("read {}: {e}", f.display())));
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}
