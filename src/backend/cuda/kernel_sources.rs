// The CUDA C sources of the kernels, what NVRTC is given for them and the digest that names
// their machine code. Shared by the backend and by build.rs (which `include!`s this file to
// compile the kernels ahead of time), so that both see the same text and options.

/// The headers the sources include, by name.
pub const HEADERS: &[(&str, &str)] = &[
    (
        "common.cuh",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/common.cuh")),
    ),
    (
        "outputs.cuh",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/outputs.cuh")),
    ),
    (
        "tiles.cuh",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/tiles.cuh")),
    ),
];

/// Every kernel source: (file name, text, kernels it defines).
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "spots.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/spots.cu")),
        &["spots_f64"],
    ),
    (
        "assemble.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/assemble.cu")),
        &[
            "column_table",
            "assemble_f64",
            "downdate_f64",
            "regularize_f64",
        ],
    ),
    (
        "factor.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/factor.cu")),
        &["eye_f64"],
    ),
    (
        "schur.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/schur.cu")),
        &[
            "schur_sweep_f64",
            "schur_combine_f64",
            "schur_end_flux_f64",
            "schur_retry_list",
        ],
    ),
    (
        "polar.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/polar.cu")),
        &["polar_f64"],
    ),
    (
        "decorrelate.cu",
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/kernels/decorrelate.cu"
        )),
        &["decorrelate_f64"],
    ),
    (
        "finalize.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/finalize.cu")),
        &["project_f64", "chi2pix_f64"],
    ),
    (
        "reject.cu",
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/reject.cu")),
        &["outlier_test", "kept_slots", "keep_equations"],
    ),
];

/// NVRTC options besides the architecture.
pub const OPTIONS: &[&str] = &["--std=c++17"];

/// Replaces the includes of the shared headers by their text: NVRTC is given one string per
/// program, and the headers must not be looked up on the file system at run time.
pub fn expand(src: &str) -> String {
    HEADERS
        .iter()
        .fold(src.to_string(), |text, (name, header)| {
            text.replace(
                &format!("#include \"{name}\""),
                header.replace("#pragma once", "").as_str(),
            )
        })
}

/// A 64-bit FNV-1a digest of everything that shapes a source's machine code apart from the
/// compiler: its name, the architecture, the options and the expanded text. Stable across
/// builds and platforms (build.rs and the backend must agree on it).
pub fn source_digest(name: &str, text: &str, arch: &str) -> u64 {
    let material = format!("{name}\0{arch}\0{OPTIONS:?}\0{text}");
    material.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
