//! Unit tests of the host tables: waves, first spots, columns, and (ignored) their time on a full
//! frame.

use super::*;

/// The solve options of these tests: desi_proc's `--psferr 0.01`, outlier rejection or not.
fn solve_options(reject_outliers: Option<f64>) -> crate::extract::SolveOptions {
    crate::extract::SolveOptions {
        regularize: 0.0,
        psferr: 0.01,
        model: false,
        reject_outliers,
    }
}

/// `patches` in the order the backend solves them.
fn in_frame_order(patches: &[Patch]) -> Vec<&Patch> {
    let order = super::super::frame_order(patches);
    order.iter().map(|&i| &patches[i]).collect()
}

fn shape() -> Shape {
    Shape {
        nx: 3,
        ny: 3,
        nt: 4,
        nws: 2,
        wavepad: 1,
        ncore: 2,
        nblock: 3,
        nfull: 10,
        bundlesize: 4,
        ndiag: 1,
    }
}

/// Twelve live patches, four per bundle slot 0, 1 and 2, with boxes of 2 x (1 + i) pixels
/// at rows 10 + i.
fn live() -> Vec<Live> {
    (0..12)
        .map(|i| {
            let g = PatchGeometry {
                rows: 10 + i..12 + i,
                cols: 0..1 + i,
                block_fibers: if i % 2 == 0 {
                    vec![1, 2]
                } else {
                    vec![0, 1, 2]
                },
                npad: 1,
                wave0: i,
                nwavetot: 4,
            };
            (20 + i, g, i / 4)
        })
        .collect()
}

#[test]
fn quarter_waves_first_and_last_equal_ones_between() {
    // a full frame in waves of at most 800, and of what a 4 GB budget alone allows
    assert_eq!(
        wave_lengths(4700, 800),
        [200, 717, 717, 717, 717, 716, 716, 200]
    );
    assert_eq!(wave_lengths(4700, 1567), [392, 1306, 1305, 1305, 392]);
    // a call of at most a wave and a quarter: a quarter, then the rest
    assert_eq!(wave_lengths(235, 1567), [59, 176]);
    assert_eq!(wave_lengths(1000, 800), [200, 800]);
    assert_eq!(wave_lengths(1, 1567), [1]);
    assert!(wave_lengths(0, 10).is_empty());
    for (n, size) in [
        (4700, 1567),
        (4700, 10_000),
        (11, 10),
        (1, 1),
        (7, 3),
        (2, 9),
    ] {
        let l = wave_lengths(n, size);
        assert_eq!(l.iter().sum::<usize>(), n, "{n} in waves of {size}");
        assert!(l.iter().all(|&x| x > 0 && x <= size), "{l:?}");
        let quarter = n.min(size).div_ceil(4);
        assert!(l[0] <= quarter);
        let middle = &l[1..l.len() - usize::from(l.len() > 2)];
        let spread = middle.iter().max().unwrap_or(&0) - middle.iter().min().unwrap_or(&0);
        assert!(spread <= 1, "{l:?}");
    }
}

#[test]
fn first_spots_count_from_the_waves_first_bundle() {
    let (sh, live) = (shape(), live());
    // the patches of slot 1 in a wave that starts at slot 1
    let mut first = vec![0; 4 * sh.nblock];
    fill_first_spots(&live[4..8], &sh, 1, &mut first);
    // patch 4: two blocks, one leading -1; fiber f at f * nfull + wave0 within the wave
    assert_eq!(first[..3], [-1, 10 + 4, 2 * 10 + 4]);
    // patch 5: three blocks
    assert_eq!(first[3..6], [5, 10 + 5, 2 * 10 + 5]);
    // the same patches in a wave that starts at slot 0: one bundle further
    fill_first_spots(&live[4..8], &sh, 0, &mut first);
    assert_eq!(first[3..6], [40 + 5, 40 + 10 + 5, 40 + 2 * 10 + 5]);
    let wave = Wave {
        slots: 1..3,
        ..Wave::default()
    };
    assert_eq!((wave.spot0(&sh), wave.nspots(&sh)), (4 * 10, 2 * 4 * 10));
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn columns_are_uploaded_once_in_one_range() {
    assert_eq!(new_columns(None, 10..20), (10..20, vec![10..20]));
    // within: nothing new
    assert_eq!(new_columns(Some(5..30), 10..20), (5..30, vec![]));
    // to the right, overlapping, and beyond a gap (filled)
    assert_eq!(new_columns(Some(10..20), 15..25), (10..25, vec![20..25]));
    assert_eq!(new_columns(Some(10..20), 30..40), (10..40, vec![20..40]));
    // on both sides
    assert_eq!(
        new_columns(Some(10..20), 5..25),
        (5..25, vec![5..10, 20..25])
    );
}

#[test]
fn packed_columns_follow_each_other_row_by_row() {
    let image = ndarray::Array2::from_shape_fn((3, 5), |(r, c)| (10 * r + c) as f32);
    let mut out = vec![-1.0; 10];
    pack_columns(&image, &mut out[..6], 1..3);
    pack_columns(&image, &mut out[6..9], 4..5);
    assert_eq!(
        out,
        [1.0, 2.0, 11.0, 12.0, 21.0, 22.0, 4.0, 14.0, 24.0, -1.0]
    );
}

/// A full r frame of a bundled PSF (500 fibers, 5760-7620 A in 0.8 A bins) on a blank CCD.
fn full_frame() -> (GaussHermitePsf, crate::plan::Plan, crate::image::Image) {
    full_frame_of("psf-r0-00067784.fits")
}

/// [`full_frame`] of the bundled PSF `name`.
fn full_frame_of(name: &str) -> (GaussHermitePsf, crate::plan::Plan, crate::image::Image) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    let psf = GaussHermitePsf::read(&path).expect("test PSF");
    let options = crate::plan::PlanOptions::new(5760.0, 7620.0, 0.8, 0, 500);
    let plan = crate::plan::Plan::new(options).expect("plan");
    let (nrows, ncols) = (psf.npix_y, psf.npix_x);
    let image = crate::image::Image {
        nrows,
        ncols,
        pix: ndarray::Array2::zeros((nrows, ncols)),
        ivar: ndarray::Array2::ones((nrows, ncols)),
        ..Default::default()
    };
    (psf, plan, image)
}

/// The host tables of a full frame as the backend's thread builds them, wave by wave, in
/// waves of at most 1567 patches (what a 4 GB budget allows), and the strips of the image
/// they pack: prints the time of each part (run with `--ignored --nocapture`).
#[test]
#[ignore = "a timing: run with --ignored --nocapture"]
fn host_tables_of_a_full_frame() {
    let (psf, plan, image) = full_frame();
    let options = solve_options(None);
    let traces = Instant::now();
    let traces = (
        crate::psf::TraceTable::new(&psf, plan.solved_fibers(), &plan.fullwave),
        traces.elapsed().as_secs_f64() * 1e3,
    );
    let corners = Instant::now();
    let _ = psf.corners(plan.solved_fibers(), &plan.fullwave);
    println!(
        "traces evaluated ahead, on one thread: {:.1} ms (their corners alone {:.1} ms)",
        traces.1,
        corners.elapsed().as_secs_f64() * 1e3
    );
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let ordered = in_frame_order(&plan.patches);
    let sh = Shape::new(&input, &plan.patches);
    // reused from frame to frame, as the backend's are
    let mut buffers = Some(Uploads::pageable());
    for round in 0..6 {
        // evaluated in place, then copied from the traces evaluated ahead
        let ahead = round >= 3;
        let input = input.with_traces(Some(&traces.0).filter(|_| ahead));
        let t0 = Instant::now();
        let uploads = buffers.take().expect("returned");
        let mut host = FrameHost::new(&input, &ordered, &sh, uploads, 1567);
        let mut pack_ms = 0.0;
        for pi in 0..host.nplanned() {
            let Some(wi) = host.prepare_wave(&input, &ordered, &sh, pi) else {
                continue;
            };
            for cols in std::mem::take(&mut host.waves[wi].strips) {
                let t = Instant::now();
                host.pack_strip(&input, cols).expect("packed");
                pack_ms += t.elapsed().as_secs_f64() * 1e3;
            }
        }
        let total = t0.elapsed().as_secs_f64() * 1e3;
        println!(
            "round {round} (ahead: {ahead}): {} waves, traces {:.1} ms, layout and boxes {:.1} ms, image strips {pack_ms:.1} ms, all {total:.1} ms",
            host.waves.len(),
            host.trace_ms,
            host.prep_ms - host.trace_ms,
        );
        assert_eq!(host.live.len() + host.off.len(), ordered.len());
        assert!(
            host.corners.iter().all(|c| c.is_some()),
            "every bundle traced"
        );
        buffers = Some(host.buffers);
    }
}

/// Every wave of `plan`'s frame prepared, with the traces evaluated ahead or not: the live
/// patches and boxes, and the tables as uploaded (trace positions then Legendre coefficients
/// as bits; corners then first spots).
fn prepared(input: &FrameInput<'_>, wave_max: usize) -> (Vec<Live>, Vec<i32>, Vec<u64>, Vec<i32>) {
    let patches = &input.plan.patches;
    let ordered = in_frame_order(patches);
    let sh = Shape::new(input, patches);
    let mut host = FrameHost::new(input, &ordered, &sh, Uploads::pageable(), wave_max);
    for pi in 0..host.nplanned() {
        host.prepare_wave(input, &ordered, &sh, pi);
    }
    let (spots, coefs) = host.table_lens(&sh);
    let reals = host.buffers.reals.current(spots + coefs);
    let ints = host.buffers.ints.current(spots + ordered.len() * sh.nblock);
    let bits = reals.iter().map(|v| v.to_bits()).collect();
    (host.live, host.boxes, bits, ints.to_vec())
}

#[test]
fn tables_from_traces_evaluated_ahead_equal_those_evaluated_in_place() {
    let (psf, _, image) = full_frame();
    // fibers 30-69: the table holds their padded neighbours, not the rest of their bundles,
    // which the tables evaluate in place
    let options = crate::plan::PlanOptions::new(6000.0, 6400.0, 0.8, 30, 40);
    let plan = crate::plan::Plan::new(options).expect("plan");
    let solve = solve_options(None);
    let traces = crate::psf::TraceTable::new(&psf, plan.solved_fibers(), &plan.fullwave);
    // the two bundles 25-74 hold fibers the table does not
    let bundles = plan.bundles();
    assert_eq!(bundles.len(), 2);
    assert!(traces.fibers.len() < 50, "{:?}", traces.fibers);
    let some = plan.solved_fibers().start;
    assert!(
        traces.is_on(&plan.fullwave) && traces.fiber(some).is_some(),
        "the tables copy some"
    );
    let input = FrameInput::new(&plan, &psf, &image, &solve);
    let ahead = input.with_traces(Some(&traces));
    for wave_max in [7, 1000] {
        let (live, boxes, reals, ints) = prepared(&input, wave_max);
        let (live_a, boxes_a, reals_a, ints_a) = prepared(&ahead, wave_max);
        assert!(!live.is_empty());
        assert_eq!(live.len(), live_a.len());
        for ((i, g, s), (ia, ga, sa)) in live.iter().zip(&live_a) {
            assert_eq!(
                (i, &g.rows, &g.cols, g.wave0, s),
                (ia, &ga.rows, &ga.cols, ga.wave0, sa)
            );
        }
        assert_eq!(boxes, boxes_a);
        assert!(reals == reals_a, "trace positions or coefficients differ");
        assert!(ints == ints_a, "corners or first spots differ");
    }
}

#[test]
fn strips_pinned_ahead_hold_every_strip_of_the_frame() {
    for name in ["psf-r0-00067784.fits", "psf-r0-00051060.fits"] {
        strips_pinned_ahead_hold_every_strip(name);
    }
}

fn strips_pinned_ahead_hold_every_strip(name: &str) {
    let (psf, plan, image) = full_frame_of(name);
    let solve = solve_options(None);
    let traces = crate::psf::TraceTable::new(&psf, plan.solved_fibers(), &plan.fullwave);
    let input = FrameInput::new(&plan, &psf, &image, &solve);
    let ordered = in_frame_order(&plan.patches);
    let sh = Shape::new(&input, &plan.patches);
    let ahead = input.with_traces(Some(&traces));
    for wave_max in [300, 1567] {
        let mut host = FrameHost::new(&ahead, &ordered, &sh, Uploads::pageable(), wave_max);
        let bound = largest_strip(&ahead, &ordered, &host.planned, &sh).expect("traces held");
        assert!(largest_strip(&input, &ordered, &host.planned, &sh).is_none());
        let mut largest = 0;
        for pi in 0..host.nplanned() {
            let wi = host.prepare_wave(&ahead, &ordered, &sh, pi).expect("live");
            for cols in &host.waves[wi].strips {
                largest = largest.max(2 * image.nrows * cols.len());
            }
        }
        assert!(largest > 0 && largest <= bound, "{largest} > {bound}");
        // not the whole CCD: the columns of one wave
        assert!(bound < 2 * image.nrows * image.ncols, "{bound}");
        // pinned only once the caller says so (after the frame's device allocations), then
        // at the sizes laid out
        assert!(!host.buffers.reals.pinning_allowed());
        host.start_pinning();
        assert!(host.buffers.reals.pinning_allowed() && host.buffers.ints.pinning_allowed());
        assert!(host.buffers.strips.iter().all(|s| s.pinning_allowed()));
        println!("{name}, waves of {wave_max}: largest strip {largest}, pinned {bound} values");
    }
}

/// Runs `test` on a frame of 25 fibers over 6000-6400 A of the full frame's image that rejects
/// outliers: its input, patches in frame order, shape and host tables (waves of at most 20
/// patches, none prepared yet).
fn with_rejecting_frame(test: impl FnOnce(&FrameInput, &[&Patch], &Shape, FrameHost)) {
    let (psf, _, image) = full_frame();
    let options = crate::plan::PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25);
    let plan = crate::plan::Plan::new(options).expect("plan");
    let solve = solve_options(Some(5.0));
    let input = FrameInput::new(&plan, &psf, &image, &solve);
    let ordered = in_frame_order(&plan.patches);
    let sh = Shape::new(&input, &plan.patches);
    let host = FrameHost::new(&input, &ordered, &sh, Uploads::pageable(), 20);
    test(&input, &ordered, &sh, host);
}

/// A wave that solves again some patches of another gathers their tables in its order: each
/// patch's first spots, pixel box, kept bins and model box offset as the frame's tables hold
/// them, and its live entries and offsets for the results.
#[test]
fn a_wave_of_picked_patches_gathers_their_tables() {
    with_rejecting_frame(|input, ordered, sh, mut host| {
        for pi in 0..host.nplanned() {
            host.prepare_wave(input, ordered, sh, pi);
        }
        let w = host.waves[1].clone();
        assert!(w.len() >= 4, "{w:?}");
        let picked = vec![w.live.start + 1, w.live.start + 3];
        let again = Wave {
            live: w.live.start..w.live.start + 2,
            picked: picked.clone(),
            ..w.clone()
        };
        let t = host.picked_tables(sh, &again);
        let nb = sh.nblock;
        for (k, &li) in picked.iter().enumerate() {
            assert_eq!(
                t.first_spots[k * nb..(k + 1) * nb],
                host.first_spots(sh, li..li + 1)[..nb]
            );
            assert_eq!(t.boxes[4 * k..4 * k + 4], host.boxes[4 * li..4 * li + 4]);
            assert_eq!((t.nkeep[k], t.boxoff[k]), (host.nkeep[li], host.boxoff[li]));
        }
        assert_eq!(t.nkeep.len(), 2);
        // a wave whose spots and model boxes start with its first picked patch's
        let li = picked[0];
        let later = Wave {
            slots: host.live[li].2..w.slots.end,
            boxes: host.box_at[li]..w.boxes.end,
            ..again.clone()
        };
        let moved = host.picked_tables(sh, &later);
        let shift = (later.slots.start - w.slots.start) * sh.bundlesize * sh.nfull;
        for (m, f) in moved.first_spots[..nb].iter().zip(&t.first_spots[..nb]) {
            assert_eq!(*m, if *f < 0 { -1 } else { f - shift as i32 });
        }
        assert_eq!(moved.boxoff, [0, t.boxoff[1] - t.boxoff[0]]);
        assert_eq!(host.first_box(&later), 0);
        assert_eq!(host.first_box(&again), host.boxoff[li] as usize);
        host.waves.push(again);
        let (live, boxoff) = host.wave_patches(host.waves.len() - 1);
        assert_eq!(live[1].0, host.live[picked[1]].0);
        assert_eq!(boxoff[..], [host.boxoff[picked[0]], host.boxoff[picked[1]]]);
        let (live, _) = host.wave_patches(1);
        assert_eq!(live.len(), w.len());
    });
}

/// A frame's outlier counts are sized at its first wave from its patch count
/// (`reject::prepare_wave`), so that no later wave moves them while the host reads a wave's:
/// the count bounds the live patches of every wave, which grow wave by wave.
#[test]
fn the_patch_count_bounds_the_live_patches_from_the_first_wave() {
    with_rejecting_frame(|input, ordered, sh, mut host| {
        assert_eq!(host.npatches(), ordered.len());
        let mut grown = 0;
        for pi in 0..host.nplanned() {
            let before = host.live.len();
            host.prepare_wave(input, ordered, sh, pi);
            assert!(host.live.len() <= host.npatches(), "wave {pi}");
            grown += usize::from(before > 0 && host.live.len() > before);
        }
        assert!(grown > 0, "the live patches grew after the first wave");
    });
}
