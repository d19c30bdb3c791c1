//! The SVG plots of a study: one line with markers per series over the finished points.

use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::Plot;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 560;

/// Distinguishable line colours (the "tab10" set).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

type Series = Vec<(String, Vec<(f64, f64)>)>;

/// The points of `rows` (CSV cells under `columns`) that finished `ok` and have a numeric x and
/// y (positive on a log axis), grouped by the series column in order of first appearance and
/// sorted by x.
pub fn series(plot: &Plot, columns: &[String], rows: &[&Vec<String>]) -> Series {
    let col = |name: &str| columns.iter().position(|c| c == name);
    let (Some(xi), Some(yi)) = (col(&plot.x), col(&plot.y)) else {
        return Vec::new();
    };
    let si = plot.series.as_deref().and_then(col);
    let status = col("status");
    let mut out: Series = Vec::new();
    for r in rows {
        if status.and_then(|i| r.get(i)).map(String::as_str) != Some("ok") {
            continue;
        }
        let num = |i: usize| {
            r.get(i)
                .and_then(|c| c.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite())
        };
        let (Some(x), Some(y)) = (num(xi), num(yi)) else {
            continue;
        };
        if (plot.log_x && x <= 0.0) || (plot.log_y && y <= 0.0) {
            continue;
        }
        let name = si.and_then(|i| r.get(i)).cloned().unwrap_or_default();
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some((_, pts)) => pts.push((x, y)),
            None => out.push((name, vec![(x, y)])),
        }
    }
    for (_, pts) in &mut out {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// The legend's line for each series (`column = value`), none without a series column.
fn legend_labels(plot: &Plot, data: &[(String, Vec<(f64, f64)>)]) -> Vec<String> {
    match &plot.series {
        Some(col) => data
            .iter()
            .map(|(name, _)| {
                let value = if name.is_empty() { "(unset)" } else { name };
                format!("{col} = {value}")
            })
            .collect(),
        None => Vec::new(),
    }
}

/// Renders `plot` as an SVG document.
pub fn render(plot: &Plot, columns: &[String], rows: &[&Vec<String>]) -> Result<String, String> {
    let data = series(plot, columns, rows);
    let xs = range(
        data.iter().flat_map(|s| s.1.iter().map(|p| p.0)),
        plot.log_x,
    );
    let ys = range(
        data.iter().flat_map(|s| s.1.iter().map(|p| p.1)),
        plot.log_y,
    );
    let fail = |e: String| format!("plot {}: {e}", plot.file);
    let labels = legend_labels(plot, &data);
    // The legend gets a column of its own right of the chart, so it never hides a point.
    let legend_width = labels
        .iter()
        .map(|l| l.chars().count() as u32 * 8 + 60)
        .max()
        .unwrap_or(0)
        .min(420);
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (WIDTH + legend_width, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
        let (chart_area, legend_area) = root.split_horizontally(WIDTH);
        let mut builder = ChartBuilder::on(&chart_area);
        builder
            .caption(&plot.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(80);
        let (x, y) = (xs.0..xs.1, ys.0..ys.1);
        let (bx, by) = (log_base(xs), log_base(ys));
        match (plot.log_x, plot.log_y) {
            (false, false) => draw(builder, x, y, plot, &data),
            (true, false) => draw(builder, x.log_scale().base(bx), y, plot, &data),
            (false, true) => draw(builder, x, y.log_scale().base(by), plot, &data),
            (true, true) => draw(
                builder,
                x.log_scale().base(bx),
                y.log_scale().base(by),
                plot,
                &data,
            ),
        }
        .map_err(fail)?;
        for (i, label) in labels.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let y = 60 + 24 * i as i32;
            let text = ("sans-serif", 14)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center));
            legend_area
                .draw(&PathElement::new(
                    vec![(8, y), (36, y)],
                    color.stroke_width(2),
                ))
                .and_then(|()| legend_area.draw(&Circle::new((22, y), 4, color.filled())))
                .and_then(|()| legend_area.draw(&Text::new(label.as_str(), (44, y), text)))
                .map_err(|e| fail(e.to_string()))?;
        }
        if data.is_empty() {
            let style = ("sans-serif", 18).into_font().color(&BLACK);
            root.draw(&Text::new(
                "no finished point has both values",
                (WIDTH as i32 / 2 - 140, HEIGHT as i32 / 2),
                style,
            ))
            .map_err(|e| fail(e.to_string()))?;
        }
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(svg)
}

fn draw<X, Y>(
    mut builder: ChartBuilder<'_, '_, SVGBackend<'_>>,
    x: X,
    y: Y,
    plot: &Plot,
    data: &Series,
) -> Result<(), String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    let mut chart = builder.build_cartesian_2d(x, y).map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(plot.x_label.as_str())
        .y_desc(plot.y_label.as_str())
        .x_label_formatter(&|v| number(*v))
        .y_label_formatter(&|v| number(*v))
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    for (i, (_, pts)) in data.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(std::iter::once(PathElement::new(
                pts.clone(),
                color.stroke_width(2),
            )))
            .map_err(err)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(err)?;
    }
    Ok(())
}

/// The axis range of `values`, padded a little (multiplicatively on a log axis).
fn range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        let f = if hi > lo { (hi / lo).powf(0.05) } else { 2.0 };
        (lo / f, hi * f)
    } else if hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    } else {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - pad, hi + pad)
    }
}

/// Ticks at powers of two over a short range (chip counts), of ten over a long one.
fn log_base((lo, hi): (f64, f64)) -> f64 {
    if hi / lo <= 4096.0 { 2.0 } else { 10.0 }
}

/// A tick label: short, scientific for very large or small values.
fn number(v: f64) -> String {
    fn trim(s: &str) -> &str {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.')
        } else {
            s
        }
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        let s = format!("{v:.2e}");
        match s.split_once('e') {
            Some((m, e)) => format!("{}e{e}", trim(m)),
            None => s,
        }
    } else {
        trim(&format!("{v:.4}")).to_string()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn plot(series: Option<&str>, log: bool) -> Plot {
        Plot {
            file: "p.svg".into(),
            title: "T & <title>".into(),
            x: "chips".into(),
            y: "bw".into(),
            series: series.map(String::from),
            log_x: log,
            log_y: log,
            x_label: "chips".into(),
            y_label: "GB/s".into(),
        }
    }

    fn rows() -> Vec<Vec<String>> {
        let r = |chips: &str, status: &str, bw: &str, wrap: &str| {
            vec![chips.into(), status.into(), bw.into(), wrap.into()]
        };
        vec![
            r("16", "ok", "20.5", "true"),
            r("4", "ok", "10", "true"),
            r("4", "ok", "8", "false"),
            r("8", "error", "9", "false"),
            r("8", "ok", "", "false"),
            r("0", "ok", "3", "false"),
        ]
    }

    fn columns() -> Vec<String> {
        ["chips", "status", "bw", "wrap"].map(String::from).to_vec()
    }

    #[test]
    fn series_skip_failed_missing_and_non_positive_on_log_axes() {
        let rows = rows();
        let refs: Vec<&Vec<String>> = rows.iter().collect();
        let s = series(&plot(Some("wrap"), false), &columns(), &refs);
        assert_eq!(
            s,
            vec![
                ("true".to_string(), vec![(4.0, 10.0), (16.0, 20.5)]),
                ("false".to_string(), vec![(0.0, 3.0), (4.0, 8.0)]),
            ]
        );
        let s = series(&plot(Some("wrap"), true), &columns(), &refs);
        assert_eq!(s[1], ("false".to_string(), vec![(4.0, 8.0)]));
        let s = series(&plot(None, false), &columns(), &refs);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].1.len(), 4);
    }

    #[test]
    fn svg_has_title_labels_and_legend() {
        let rows = rows();
        let refs: Vec<&Vec<String>> = rows.iter().collect();
        for log in [false, true] {
            let svg = render(&plot(Some("wrap"), log), &columns(), &refs).unwrap();
            assert!(svg.contains("<svg"), "{svg}");
            assert!(svg.contains("T &amp; &lt;title&gt;"));
            // plotters writes each text on a line of its own.
            assert!(svg.contains("\nGB/s\n") && svg.contains("\nchips\n"));
            assert!(svg.contains("wrap = true") && svg.contains("wrap = false"));
            assert!(svg.contains("<circle"));
        }
        let empty = render(&plot(None, true), &columns(), &[]).unwrap();
        assert!(empty.contains("no finished point has both values"));
    }

    #[test]
    fn tick_labels() {
        assert_eq!(number(0.0), "0");
        assert_eq!(number(2.5), "2.5");
        assert_eq!(number(100.0), "100");
        assert_eq!(number(1_000_000.0), "1e6");
        assert_eq!(number(0.000_25), "2.5e-4");
    }
}
