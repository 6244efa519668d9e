//! The checked-in PTX modules against the kernel registry (src/registry.rs):
//! each module has exactly the registry's kernels for it, each with the registry's launch
//! bound, cluster size and parameter sizes (src/params.rs). build.rs writes them from the same table; this catches a checked-in
//! file that was edited by hand or came from another table, and counts the cluster kernels
//! that CI once counted with grep.

use std::collections::BTreeMap;

use layernorm_layout::params::param_bytes;
use layernorm_layout::registry::{Arch, DTYPES, Variant};

const SM80: &str = include_str!("../../layernorm_kernels.ptx");
const SM90: &str = include_str!("../../layernorm_kernels_sm90.ptx");

/// Kernel name -> (.maxntid x, .reqnctapercluster x or 1), as the module declares them.
fn declared(ptx: &str) -> BTreeMap<String, (u32, u32)> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            let name = entry.split('(').next().unwrap().to_string();
            out.insert(name.clone(), (0, 1));
            current = Some(name);
        }
        let Some(name) = &current else { continue };
        let first = |directive: &str| -> Option<u32> {
            let rest = line.strip_prefix(directive)?;
            rest.split(',').next()?.trim().parse().ok()
        };
        if let Some(n) = first(".maxntid ") {
            out.get_mut(name).unwrap().0 = n;
        }
        if let Some(c) = first(".reqnctapercluster ") {
            out.get_mut(name).unwrap().1 = c;
        }
    }
    out
}

fn expected(arch: Arch) -> BTreeMap<String, (u32, u32)> {
    Variant::ALL
        .iter()
        .filter(|v| v.in_module(arch))
        .flat_map(|&v| {
            DTYPES.iter().enumerate().map(move |(d, ty)| {
                (
                    format!("layer_norm_{}_{ty}", v.stem()),
                    (v.max_threads(arch, d), v.cluster()),
                )
            })
        })
        .collect()
}

#[test]
fn checked_in_modules_declare_the_registry() {
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        assert_eq!(declared(ptx), expected(arch), "{arch:?} module");
    }
}

#[test]
fn only_the_sm90_module_has_cluster_kernels() {
    let clusters = |ptx| declared(ptx).values().filter(|(_, c)| *c > 1).count();
    assert_eq!(clusters(SM80), 0);
    // The general cluster kernel over 8 blocks and the held ones over 2, 4 and 8, in three types.
    assert_eq!(clusters(SM90), 12);
}

/// Kernel name -> the bytes of each parameter it declares: `.param .align A .b8 name[B]` (a
/// struct by value) is B, `.param .u32` is 4.
fn declared_params(ptx: &str) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            let name = entry.split('(').next().unwrap().to_string();
            out.insert(name.clone(), Vec::new());
            current = Some(name);
            continue;
        }
        let Some(name) = &current else { continue };
        let Some(param) = line.trim().strip_prefix(".param ") else {
            if line.starts_with(')') {
                current = None;
            }
            continue;
        };
        let bytes = if let Some(array) = param.split('[').nth(1) {
            array.split(']').next().unwrap().parse().unwrap()
        } else if param.starts_with(".u32") || param.starts_with(".f32") {
            4
        } else {
            panic!("{name}: a parameter this test does not know: {param}")
        };
        out.get_mut(name).unwrap().push(bytes);
    }
    out
}

#[test]
fn checked_in_modules_take_the_parameter_structs() {
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        let expected: BTreeMap<String, Vec<usize>> = Variant::ALL
            .iter()
            .filter(|v| v.in_module(arch))
            .flat_map(|&v| {
                DTYPES
                    .iter()
                    .map(move |ty| (format!("layer_norm_{}_{ty}", v.stem()), param_bytes(v).to_vec()))
            })
            .collect();
        assert_eq!(declared_params(ptx), expected, "{arch:?} module");
    }
}
