//! Drawing the quick-look picture with plotters into an RGB buffer: the header, the four
//! frame maps, the pull histogram and the residual image. Text is drawn with a font shipped
//! in the repository (assets/fonts), so that no system font is needed.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::scale::{self, Scale};
use super::{Panel, PanelKind, QuickLook, Residual, MAP_HEIGHT, WIDTH};
use crate::compare::Pulls;
use crate::frame::{median, Frame};

/// Height of the header line that names the frame.
pub(super) const HEADER_HEIGHT: u32 = 36;
/// Height of each panel's title line.
const TITLE_HEIGHT: u32 = 26;
/// Room for the tick labels and the axis names.
const X_LABELS: u32 = 40;
const Y_LABELS: u32 = 76;
const MARGIN: u32 = 14;
/// The font family registered with plotters for every text of the picture.
const FONT: &str = "spex-mono";
const TEXT_SIZE: u32 = 15;
/// Pulls outside this range are counted, not drawn.
const PULL_RANGE: f64 = 6.0;
const PULL_BIN: f64 = 0.25;
const BAR: RGBColor = RGBColor(70, 130, 180);
const GAUSSIAN: RGBColor = RGBColor(214, 39, 40);

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type Drawn<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Registers the shipped font once per process.
fn register_font() -> Drawn<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = REGISTERED.get_or_init(|| {
        let bytes = include_bytes!("../../assets/fonts/DejaVuSansMono.ttf");
        plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok()
    });
    if *ok {
        Ok(())
    } else {
        Err("the shipped font does not load".into())
    }
}

/// Draws the picture into a row-major RGB buffer of [`QuickLook::size`] and says where each
/// panel's data went.
pub(super) fn render(ql: &QuickLook) -> Drawn<(Vec<u8>, Vec<Panel>)> {
    register_font()?;
    let (w, h) = ql.size();
    let mut buffer = vec![0u8; (w * h * 3) as usize];
    let mut panels = Vec::new();
    {
        let root = BitMapBackend::with_buffer(&mut buffer, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let (header, rest) = root.split_vertically(HEADER_HEIGHT);
        let f = &ql.frame;
        let title = format!(
            "{}: fibers {}-{}, {} bins {:.1}-{:.1} A",
            ql.name,
            f.specmin,
            f.specmin + f.nspec.saturating_sub(1),
            f.nwave(),
            f.wave.first().copied().unwrap_or(0.0),
            f.wave.last().copied().unwrap_or(0.0)
        );
        header.draw(&Text::new(title, (MARGIN as i32, 8), (FONT, 20)))?;
        let (maps, bottom) = rest.split_vertically(4 * MAP_HEIGHT);
        let rows = maps.split_evenly((4, 1));
        panels.push(flux_map(&rows[0], f)?);
        panels.push(ivar_map(&rows[1], f)?);
        panels.push(mask_map(&rows[2], f)?);
        panels.push(chi2pix_map(&rows[3], f)?);
        if ql.pulls.is_some() || ql.residual.is_some() {
            let (left, right) = bottom.split_horizontally(WIDTH * 2 / 5);
            match &ql.pulls {
                Some(p) => panels.push(pull_histogram(&left, p)?),
                None => note(&left, "pull histogram: give --truth TRUTH")?,
            }
            match &ql.residual {
                Some(r) => panels.push(residual_map(&right, r)?),
                None => note(&right, "residual image: give --model MODEL --image PREPROC")?,
            }
        }
        debug_assert_eq!(bottom.dim_in_pixel().1, h - HEADER_HEIGHT - 4 * MAP_HEIGHT);
        root.present()?;
    }
    Ok((buffer, panels))
}

/// A text in place of a panel whose input was not given.
fn note(area: &Area, text: &str) -> Drawn<()> {
    area.draw(&Text::new(
        text.to_string(),
        (MARGIN as i32 + Y_LABELS as i32, 2 * TITLE_HEIGHT as i32),
        (FONT, TEXT_SIZE)
            .into_font()
            .color(&RGBColor(110, 110, 110)),
    ))?;
    Ok(())
}

/// A number in a few significant digits.
fn num(v: f64) -> String {
    if v != 0.0 && !(1e-2..1e5).contains(&v.abs()) {
        format!("{v:.3e}")
    } else {
        format!("{v:.3}")
    }
}

/// An image of `ny` rows by `nx` columns of data under a title, with axes.
struct Map<'a> {
    kind: PanelKind,
    title: String,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    x_desc: &'a str,
    y_desc: &'a str,
    nx: usize,
    ny: usize,
    /// The colour of data row `iy` (upwards), column `ix`.
    colour: &'a dyn Fn(usize, usize) -> RGBColor,
}

/// Draws a map, nearest data value per pixel, and returns where its data went.
fn draw_map(area: &Area, map: &Map) -> Drawn<Panel> {
    let (title_area, chart_area) = area.split_vertically(TITLE_HEIGHT);
    title_area.draw(&Text::new(
        map.title.clone(),
        (MARGIN as i32 + Y_LABELS as i32, 6),
        (FONT, TEXT_SIZE),
    ))?;
    let mut chart = ChartBuilder::on(&chart_area)
        .margin_left(MARGIN)
        .margin_right(MARGIN)
        .x_label_area_size(X_LABELS)
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(map.x.clone(), map.y.clone())?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(map.x_desc)
        .y_desc(map.y_desc)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, TEXT_SIZE - 2))
        .axis_desc_style((FONT, TEXT_SIZE - 1))
        .draw()?;
    let plot = chart.plotting_area().strip_coord_spec();
    let (w, h) = plot.dim_in_pixel();
    for py in 0..h {
        let iy = ((h - 1 - py) as usize * map.ny) / h as usize;
        for px in 0..w {
            let ix = px as usize * map.nx / w as usize;
            plot.draw_pixel((px as i32, py as i32), &(map.colour)(iy, ix))?;
        }
    }
    Ok(panel(map.kind, &plot))
}

fn panel(kind: PanelKind, area: &Area) -> Panel {
    let (x, y) = area.get_pixel_range();
    Panel {
        kind,
        x: x.start as u32..x.end as u32,
        y: y.start as u32..y.end as u32,
    }
}

/// A frame map: wavelength across, fibers up.
fn frame_map(
    area: &Area,
    f: &Frame,
    kind: PanelKind,
    title: String,
    colour: &dyn Fn(usize, usize) -> RGBColor,
) -> Drawn<Panel> {
    let (w0, w1) = (f.wave[0], f.wave[f.nwave() - 1]);
    let first = f.specmin as f64;
    draw_map(
        area,
        &Map {
            kind,
            title,
            x: w0..w1.max(w0 + 1.0),
            y: first - 0.5..first + f.nspec as f64 - 0.5,
            x_desc: "wavelength [Angstrom]",
            y_desc: "fiber",
            nx: f.nwave(),
            ny: f.nspec,
            colour,
        },
    )
}

/// The values of `of` in the bins with ivar > 0.
fn weighted(f: &Frame, of: &ndarray::Array2<f64>) -> Vec<f64> {
    of.iter()
        .zip(&f.ivar)
        .filter(|(_, &iv)| iv > 0.0)
        .map(|(&v, _)| v)
        .collect()
}

/// A map of a quantity of the bins with ivar > 0 on its 1st to 99th percentile.
fn percentile_map(
    area: &Area,
    f: &Frame,
    kind: PanelKind,
    name: &str,
    of: &ndarray::Array2<f64>,
) -> Drawn<Panel> {
    let scale = Scale::percentiles(&weighted(f, of), 0.01, 0.99).unwrap_or(Scale::linear(0.0, 1.0));
    let title = format!(
        "{name}, colour from the 1st to the 99th percentile: {} to {}; grey: ivar 0",
        num(scale.lo),
        num(scale.hi)
    );
    let colour = |iy: usize, ix: usize| {
        if f.ivar[[iy, ix]] > 0.0 {
            scale.colour(of[[iy, ix]])
        } else {
            scale::MISSING
        }
    };
    frame_map(area, f, kind, title, &colour)
}

fn flux_map(area: &Area, f: &Frame) -> Drawn<Panel> {
    percentile_map(
        area,
        f,
        PanelKind::Flux,
        "FLUX [electron/Angstrom]",
        &f.flux,
    )
}

fn ivar_map(area: &Area, f: &Frame) -> Drawn<Panel> {
    percentile_map(area, f, PanelKind::Ivar, "IVAR", &f.ivar)
}

/// MASK in one colour per bit, with a legend after the title.
fn mask_map(area: &Area, f: &Frame) -> Drawn<Panel> {
    let flagged = f.mask.iter().filter(|&&m| m != 0).count();
    let title = format!("MASK: {flagged} of {} bins flagged", f.mask.len());
    let colour = |iy: usize, ix: usize| scale::mask_colour(f.mask[[iy, ix]]);
    let drawn = frame_map(area, f, PanelKind::Mask, title, &colour)?;
    let mut x = (WIDTH / 2) as i32;
    let legend = scale::MASK_COLOURS
        .iter()
        .map(|&(_, name, c)| (name, c))
        .chain([("other bits", scale::MASK_OTHER)]);
    for (name, c) in legend {
        area.draw(&Rectangle::new([(x, 7), (x + 13, 20)], c.filled()))?;
        area.draw(&Text::new(name, (x + 18, 6), (FONT, TEXT_SIZE)))?;
        x += 30 + 9 * name.len() as i32;
    }
    Ok(drawn)
}

fn chi2pix_map(area: &Area, f: &Frame) -> Drawn<Panel> {
    let values = weighted(f, &f.chi2pix);
    let hi = Scale::percentiles(&values, 0.0, 0.99).map_or(2.0, |s| s.hi.max(2.0));
    let scale = Scale::linear(0.0, hi);
    let title = format!(
        "CHI2PIX, colour from 0 to {} (99th percentile, at least 2); median {}; grey: ivar 0",
        num(hi),
        num(if values.is_empty() {
            0.0
        } else {
            median(values)
        })
    );
    let colour = |iy: usize, ix: usize| {
        if f.ivar[[iy, ix]] > 0.0 {
            scale.colour(f.chi2pix[[iy, ix]])
        } else {
            scale::MISSING
        }
    };
    frame_map(area, f, PanelKind::Chi2pix, title, &colour)
}

/// The histogram of the pulls as a density, the unit Gaussian over it, and the statistics.
fn pull_histogram(area: &Area, pulls: &[f64]) -> Drawn<Panel> {
    let nbins = (2.0 * PULL_RANGE / PULL_BIN).round() as usize;
    let mut counts = vec![0usize; nbins];
    for &p in pulls {
        let i = ((p + PULL_RANGE) / PULL_BIN).floor();
        if i >= 0.0 && (i as usize) < nbins {
            counts[i as usize] += 1;
        }
    }
    let outside = pulls.len() - counts.iter().sum::<usize>();
    let density = |c: usize| c as f64 / (pulls.len() as f64 * PULL_BIN);
    let peak = counts.iter().map(|&c| density(c)).fold(0.4f64, f64::max);
    let (title_area, chart_area) = area.split_vertically(TITLE_HEIGHT);
    title_area.draw(&Text::new(
        "pulls against the truth, and the unit Gaussian (red)",
        (MARGIN as i32 + Y_LABELS as i32, 6),
        (FONT, TEXT_SIZE),
    ))?;
    let mut chart = ChartBuilder::on(&chart_area)
        .margin_left(MARGIN)
        .margin_right(MARGIN)
        .margin_bottom(MARGIN)
        .x_label_area_size(X_LABELS)
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(-PULL_RANGE..PULL_RANGE, 0.0..1.15 * peak)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("(flux - R truth) sqrt(ivar)")
        .y_desc("density")
        .label_style((FONT, TEXT_SIZE - 2))
        .axis_desc_style((FONT, TEXT_SIZE - 1))
        .draw()?;
    chart.draw_series(counts.iter().enumerate().map(|(i, &c)| {
        let x0 = -PULL_RANGE + i as f64 * PULL_BIN;
        Rectangle::new([(x0, 0.0), (x0 + PULL_BIN, density(c))], BAR.filled())
    }))?;
    let gauss = (0..=480).map(|i| {
        let x = -PULL_RANGE + i as f64 * 2.0 * PULL_RANGE / 480.0;
        (
            x,
            (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt(),
        )
    });
    chart.draw_series(LineSeries::new(gauss, GAUSSIAN.stroke_width(2)))?;
    let s = Pulls::from_values(pulls);
    let plot = chart.plotting_area().strip_coord_spec();
    let lines = [
        format!("bins    {}", s.nbins),
        format!("mean    {:+.4}", s.mean),
        format!("std     {:.4}", s.std),
        format!("median |pull| {:.4}", s.median_abs),
        "  (Gaussian 0.6745)".to_string(),
        format!("|pull| > 5: {}", s.over5),
        format!("outside +-{PULL_RANGE}: {outside}"),
    ];
    for (i, line) in lines.into_iter().enumerate() {
        plot.draw(&Text::new(line, (8, 8 + 19 * i as i32), (FONT, TEXT_SIZE)))?;
    }
    Ok(panel(PanelKind::Pulls, &plot))
}

/// The residual of a CCD region: CCD rows across (along the wavelength), columns up.
fn residual_map(area: &Area, r: &Residual) -> Drawn<Panel> {
    let limit = 5.0;
    let scale = Scale::diverging(limit);
    let (rms, n) = r.rms();
    let title = format!(
        "(image - model) sqrt(ivar) from -{limit} to {limit}: rms {rms:.3} over {n} pixels",
    );
    let colour = |iy: usize, ix: usize| scale.colour(r.values[[ix, iy]]);
    draw_map(
        area,
        &Map {
            kind: PanelKind::Residual,
            title,
            x: r.rows.start as f64..r.rows.end as f64,
            y: r.cols.start as f64..r.cols.end as f64,
            x_desc: "CCD row",
            y_desc: "CCD column",
            nx: r.rows.len(),
            ny: r.cols.len(),
            colour: &colour,
        },
    )
}
