//! spex: spectro-perfectionism extraction of DESI CCD frames.
//!
//! The data flow of one frame: read the inputs ([`image`], [`psf`]) -> plan patches
//! ([`plan`]) -> solve them on a [`backend`] (spots, normal equations, Cholesky,
//! decorrelation; shared definitions in [`extract`]) -> stitch the patches into a [`frame`]
//! -> write it. [`simulate`] makes test frames from a PSF and [`compare`] measures frames
//! against each other or against the truth.

pub mod backend;
pub mod barycentric;
pub mod cli;
pub mod compare;
pub mod config;
pub mod error;
pub mod extract;
pub mod fits;
pub mod frame;
pub mod image;
pub mod outliers;
pub mod output;
pub mod parallel;
pub mod pipeline;
pub mod plan;
pub mod psf;
pub mod qa;
pub mod scores;
pub mod simulate;

pub use error::{Error, Result};
