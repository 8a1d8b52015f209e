//! `--plot FILE.svg`: a bandwidth bench's report as a chart — GB/s against block size (log
//! scale), one line per case (and thread count), each case's same-run ceiling drawn dashed
//! in its colour. Made with `plotters` (SVG backend only: no fonts or system libraries).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

use crate::report::{CaseResult, Report};

static PLOT: OnceLock<PathBuf> = OnceLock::new();

/// Where the report's chart goes (set once, from `--plot`).
pub fn set(path: PathBuf) {
    let _ = PLOT.set(path);
}

/// The chart's path, if asked for.
pub fn target() -> Option<&'static Path> {
    PLOT.get().map(|p| p.as_path())
}

/// One line of the chart: (block bytes, GB/s, ceiling GB/s) points of one case.
type Series = Vec<(u64, f64, f64)>;

/// The report's bandwidth cases grouped into lines (cases without a block size or a
/// bandwidth — lookups, round trips — are not bandwidths and are left out).
fn series(results: &[CaseResult]) -> BTreeMap<String, Series> {
    let mut lines: BTreeMap<String, Series> = BTreeMap::new();
    for r in results {
        if r.block_bytes == 0 || r.gbps <= 0.0 || !r.gbps.is_finite() {
            continue;
        }
        let name = if r.threads > 1 {
            format!("{} ×{}", r.case, r.threads)
        } else {
            r.case.clone()
        };
        lines
            .entry(name)
            .or_default()
            .push((r.block_bytes, r.gbps, r.ceiling_gbps));
    }
    for pts in lines.values_mut() {
        pts.sort_by_key(|p| p.0);
    }
    lines
}

fn size_label(b: u64) -> String {
    bytesize::ByteSize(b).to_string()
}

/// Writes the chart of `report` to `path`.
pub fn write(report: &Report, path: &Path) -> Result<()> {
    let lines = series(&report.results);
    if lines.is_empty() {
        return Err(anyhow!("{}: no bandwidth case to plot", report.bench));
    }
    let (mut lo, mut hi, mut top) = (u64::MAX, 0u64, 0f64);
    for pts in lines.values() {
        for &(b, g, c) in pts {
            lo = lo.min(b);
            hi = hi.max(b);
            top = top.max(g).max(if c.is_finite() { c } else { 0.0 });
        }
    }
    // Log2 x axis: plot against log2(bytes) and label ticks with sizes.
    let (x0, x1) = ((lo as f64).log2() - 0.25, (hi as f64).log2() + 0.25);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "kvd-bench {}: GB/s against block size (dashed: same-run ceiling)",
                report.bench
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0f64..top * 1.1)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("block size")
        .y_desc("GB/s")
        .x_labels(((x1 - x0).ceil() as usize + 1).max(2))
        .x_label_formatter(&|v| size_label(2f64.powf(v.round()) as u64))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let xy: Vec<(f64, f64)> = pts
            .iter()
            .map(|&(b, g, _)| ((b as f64).log2(), g))
            .collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), colour.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(xy.iter().map(|&p| Circle::new(p, 3, colour.filled())))
            .map_err(|e| anyhow!("{e}"))?;
        let ceil: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.2.is_finite() && p.2 > 0.0)
            .map(|&(b, _, c)| ((b as f64).log2(), c))
            .collect();
        chart
            .draw_series(DashedLineSeries::new(ceil, 6, 4, colour.stroke_width(1)))
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))
        .map_err(|e| anyhow!("{e:#}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str, b: u64, t: u64, g: f64, c: f64) -> CaseResult {
        CaseResult {
            case: name.into(),
            block_bytes: b,
            threads: t,
            gbps: g,
            ceiling_gbps: c,
            ..CaseResult::default()
        }
    }

    #[test]
    fn cases_become_sorted_lines_and_non_bandwidths_are_left_out() {
        let r = vec![
            case("store", 1 << 20, 1, 7.0, 9.0),
            case("store", 64 << 10, 1, 6.0, 9.5),
            case("store", 1 << 20, 2, 10.0, 12.0),
            case("lookup (keys/s)", 0, 1, 0.0, 0.0),
        ];
        let l = series(&r);
        assert_eq!(l.len(), 2);
        assert_eq!(l["store"], vec![(64 << 10, 6.0, 9.5), (1 << 20, 7.0, 9.0)]);
        assert_eq!(l["store ×2"], vec![(1 << 20, 10.0, 12.0)]);
    }

    #[test]
    fn an_svg_with_every_line_and_its_ceiling_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        let report = Report {
            bench: "store".into(),
            ceiling: crate::report::Ceiling {
                what: "memcpy".into(),
                gbps: 9.0,
            },
            results: vec![
                case("store", 64 << 10, 1, 6.0, 9.5),
                case("store", 1 << 20, 1, 7.0, 9.0),
                case("load", 1 << 20, 1, 8.0, 9.0),
            ],
            extra: Default::default(),
        };
        write(&report, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("store") && svg.contains("load"),
            "{svg}"
        );
        assert!(
            svg.contains("stroke-dasharray") || svg.matches("<polyline").count() >= 4,
            "ceilings drawn"
        );
        let empty = Report {
            results: vec![case("lookup", 0, 1, 0.0, 0.0)],
            ..report
        };
        assert!(write(&empty, &path).is_err());
    }
}
