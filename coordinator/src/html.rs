//! `report.html` and `study.html`: one self-contained page each (inline SVG and CSS, no script,
//! nothing fetched), drawn from `report.json` as written, so `podsim report DIR` can redraw a
//! page from the file alone.
//!
//! The report page shows the job and its topology, then what the job has: the step-time
//! breakdown per step (compute, exposed and hidden communication), the timeline of one step
//! of chip 0 and of the traced chip where that step took longest, each collective's virtual
//! bus bandwidth against the chip's link bandwidth, HBM per chip by kind, stragglers, and for
//! a hang the torus with the culprit, the chips waiting and the link at fault.

use std::fmt::Write as _;

use serde_json::Value;

/// Colours of slice categories and series, chosen to stay apart in print and for the most
/// common colour blindness.
const COMPUTE: &str = "#4477aa";
const EXPOSED: &str = "#ee6677";
const HIDDEN: &str = "#ccbb44";
const COLLECTIVE: &str = "#228833";
const PHASE: &str = "#66ccee";
const OTHER: &str = "#aa3377";
const IDLE: &str = "#dddddd";

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1080px;color:#222;padding:0 16px}\
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}\
th{background:#f6f6f6}.num{text-align:right;font-variant-numeric:tabular-nums}\
.status{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}\
.ok{background:#228833}.bad{background:#cc3311}.diag{background:#fff4f2;border-left:4px solid #cc3311;padding:8px 12px}\
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}\
svg text{font:11px system-ui,sans-serif;fill:#333}.muted{color:#777}";

/// Escapes text for HTML and SVG.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n",
        esc(title)
    )
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn size(bytes: f64) -> String {
    crate::units::format_size(bytes.max(0.0) as u64)
}

fn legend(items: &[(&str, &str)]) -> String {
    let mut s = String::from("<div class=\"legend\">");
    for (colour, name) in items {
        let _ = write!(
            s,
            "<span><i class=\"sw\" style=\"background:{colour}\"></i>{}</span>",
            esc(name)
        );
    }
    s.push_str("</div>\n");
    s
}

/// Vertical stacked bars: one bar per category, one stacked segment per series.
fn stacked_bars(categories: &[String], series: &[(&str, &str, Vec<f64>)], unit: &str) -> String {
    let (w, h, left, bottom) = (1000.0, 240.0, 60.0, 34.0);
    let totals: Vec<f64> = (0..categories.len())
        .map(|i| {
            series
                .iter()
                .map(|s| s.2.get(i).copied().unwrap_or(0.0))
                .sum()
        })
        .collect();
    let max = totals
        .iter()
        .copied()
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE);
    let n = categories.len().max(1) as f64;
    let slot = (w - left - 10.0) / n;
    let bar = (slot * 0.8).max(1.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n"
    );
    let plot_h = h - bottom - 10.0;
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        let y = 10.0 + plot_h * (1.0 - f64::from(k) / 4.0);
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{w}\" y2=\"{y:.1}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{} {unit}</text>",
            left - 4.0,
            y + 4.0,
            short(v)
        );
    }
    // Labels about 60 px apart, however many bars.
    let label_every = ((60.0 / slot).ceil() as usize).max(1);
    for (i, cat) in categories.iter().enumerate() {
        let x = left + slot * i as f64 + (slot - bar) / 2.0;
        let mut y = 10.0 + plot_h;
        for (name, colour, values) in series {
            let v = values.get(i).copied().unwrap_or(0.0);
            let bh = plot_h * v / max;
            y -= bh;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{bar:.1}\" height=\"{bh:.1}\" fill=\"{colour}\"><title>{}: {} {}</title></rect>",
                esc(cat),
                esc(name),
                format_args!("{} {unit}", short(v))
            );
        }
        if i % label_every == 0 {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                x + bar / 2.0,
                h - bottom + 16.0,
                esc(cat)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// A value with three significant digits.
fn short(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn slice_colour(cat: &str) -> &'static str {
    match cat {
        "kernel" => COMPUTE,
        "collective" => COLLECTIVE,
        "phase" => PHASE,
        _ => OTHER,
    }
}

/// A Gantt chart of one step: one row per track, one box per slice (hover shows its name).
fn gantt(t: &Value) -> String {
    let slices = t["slices"].as_array().cloned().unwrap_or_default();
    let total_ns = num(&t["virtual_ms"]) * 1e6;
    let mut tracks: Vec<String> = Vec::new();
    for s in &slices {
        let tr = text(&s["track"]);
        if !tracks.contains(&tr) {
            tracks.push(tr);
        }
    }
    // Phases share their collective's track: draw them in a row of their own below it.
    let rows: Vec<(String, bool)> = tracks
        .iter()
        .flat_map(|t| [(t.clone(), false), (t.clone(), true)])
        .filter(|(t, phases)| {
            slices
                .iter()
                .any(|s| text(&s["track"]) == *t && (text(&s["cat"]) == "phase") == *phases)
        })
        .collect();
    let (w, left, row_h) = (1000.0, 150.0, 22.0);
    let h = 30.0 + row_h * rows.len() as f64;
    let scale = (w - left - 10.0) / total_ns.max(1.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n"
    );
    for (r, (track, phases)) in rows.iter().enumerate() {
        let y = 4.0 + row_h * r as f64;
        let label = if *phases {
            format!("{track} (phases)")
        } else {
            track.clone()
        };
        let _ = writeln!(
            s,
            "<rect x=\"{left}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#f7f7f7\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            w - left - 10.0,
            row_h - 4.0,
            left - 6.0,
            y + 13.0,
            esc(&label)
        );
        for sl in slices
            .iter()
            .filter(|sl| text(&sl["track"]) == *track && (text(&sl["cat"]) == "phase") == *phases)
        {
            let (a, b) = (num(&sl["start_ns"]), num(&sl["end_ns"]));
            let x = left + a * scale;
            let bw = ((b - a) * scale).max(0.6);
            let _ = writeln!(
                s,
                "<rect x=\"{x:.2}\" y=\"{:.1}\" width=\"{bw:.2}\" height=\"{:.1}\" fill=\"{}\"><title>{} ({} us)</title></rect>",
                y + 1.0,
                row_h - 6.0,
                slice_colour(&text(&sl["cat"])),
                esc(&text(&sl["name"])),
                short((b - a) / 1e3)
            );
        }
    }
    let y = h - 10.0;
    for k in 0..=4 {
        let x = left + (w - left - 10.0) * f64::from(k) / 4.0;
        let anchor = if k == 4 { "end" } else { "middle" };
        let _ = writeln!(
            s,
            "<text x=\"{x:.1}\" y=\"{y}\" text-anchor=\"{anchor}\">{} ms</text>",
            short(total_ns / 1e6 * f64::from(k) / 4.0)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Horizontal bars of each collective's virtual bus bandwidth, with the bound drawn across.
fn bandwidth(collectives: &[Value], bound_gbps: f64) -> String {
    let (w, left, row_h) = (1000.0, 320.0, 22.0);
    let h = 28.0 + row_h * collectives.len() as f64;
    let max = collectives
        .iter()
        .map(|c| num(&c["virtual_busbw_gbps"]))
        .fold(bound_gbps, f64::max)
        .max(f64::MIN_POSITIVE);
    let scale = (w - left - 70.0) / max;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n"
    );
    for (i, c) in collectives.iter().enumerate() {
        let y = 4.0 + row_h * i as f64;
        let v = num(&c["virtual_busbw_gbps"]);
        let label = format!(
            "#{} {} {} {} ({})",
            text(&c["step"]),
            text(&c["op"]),
            size(num(&c["bytes"])),
            text(&c["algo"]),
            text(&c["group"])
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text><rect x=\"{left}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{COLLECTIVE}\"/><text x=\"{:.1}\" y=\"{:.1}\">{} GB/s</text>",
            left - 6.0,
            y + 13.0,
            esc(&label),
            v * scale,
            row_h - 6.0,
            left + v * scale + 4.0,
            y + 13.0,
            short(v)
        );
    }
    let x = left + bound_gbps * scale;
    let _ = writeln!(
        s,
        "<line x1=\"{x:.1}\" y1=\"0\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{EXPOSED}\" stroke-dasharray=\"4 3\"/><text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">bound {} GB/s</text>",
        h - 18.0,
        h - 4.0,
        short(bound_gbps)
    );
    s.push_str("</svg>\n");
    s
}

/// Shape of the torus from `"16x16x16"`.
fn dims(shape: &str) -> Vec<u32> {
    shape.split('x').filter_map(|d| d.parse().ok()).collect()
}

fn in_ranges(ranges: &[(u32, u32)], chip: u32) -> bool {
    let i = ranges.partition_point(|r| r.1 < chip);
    ranges.get(i).is_some_and(|r| r.0 <= chip)
}

/// The chips that wait on the culprit, as the report lists them: inclusive id ranges.
fn waiting_ranges(hang: &Value) -> Vec<(u32, u32)> {
    hang["waiting_chips"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| Some((r[0].as_u64()? as u32, r[1].as_u64()? as u32)))
                .collect()
        })
        .unwrap_or_default()
}

/// The torus of the culprit's slice, unrolled along z into x-y panels (only the culprit's
/// panel and its neighbours on large tori), with the culprit, the waiting chips and the link.
fn torus_picture(report: &Value, hang: &Value) -> String {
    let d = dims(&text(&report["topology"]["shape"]));
    let (x_n, y_n, z_n) = (
        d.first().copied().unwrap_or(1),
        d.get(1).copied().unwrap_or(1),
        d.get(2).copied().unwrap_or(1),
    );
    let per_slice = x_n * y_n * z_n;
    let culprit = hang["culprit"]["chip"].as_u64().map(|c| c as u32);
    let slice = culprit.map_or(0, |c| c / per_slice.max(1));
    let ranges = waiting_ranges(hang);
    let cz = culprit.map_or(0, |c| (c % per_slice) / (x_n * y_n));
    let zs: Vec<u32> = if per_slice <= 4096 {
        (0..z_n).collect()
    } else {
        (cz.saturating_sub(1)..=(cz + 1).min(z_n - 1)).collect()
    };
    let cell = (300.0 / f64::from(x_n.max(y_n))).clamp(3.0, 40.0);
    let (pw, ph) = (cell * f64::from(x_n) + 16.0, cell * f64::from(y_n) + 30.0);
    let cols = ((1000.0 / pw).floor() as usize).max(1);
    let rows = zs.len().div_ceil(cols);
    let (w, h) = (1000.0, ph * rows as f64 + 4.0);
    let link = text(&hang["culprit"]["link"]);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h:.0}\" viewBox=\"0 0 {w} {h:.0}\">\n"
    );
    for (k, &z) in zs.iter().enumerate() {
        let (ox, oy) = (pw * (k % cols) as f64, ph * (k / cols) as f64);
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\">z = {z}{}</text>",
            ox,
            oy + 12.0,
            if slice > 0 {
                format!(", slice {slice}")
            } else {
                String::new()
            }
        );
        for y in 0..y_n {
            for x in 0..x_n {
                let chip = slice * per_slice + x + x_n * (y + y_n * z);
                let (fill, stroke) = if Some(chip) == culprit {
                    (EXPOSED, "#000")
                } else if in_ranges(&ranges, chip) {
                    (HIDDEN, "none")
                } else {
                    (IDLE, "none")
                };
                let _ = writeln!(
                    s,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{fill}\" stroke=\"{stroke}\"><title>chip {chip} ({x}, {y}, {z})</title></rect>",
                    ox + f64::from(x) * cell,
                    oy + 18.0 + f64::from(y) * cell,
                    cell - 0.6,
                    cell - 0.6
                );
                if cell >= 24.0 {
                    let _ = writeln!(
                        s,
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{chip}</text>",
                        ox + (f64::from(x) + 0.5) * cell,
                        oy + 18.0 + (f64::from(y) + 0.5) * cell + 4.0
                    );
                }
            }
        }
        // The link at fault, drawn from the culprit towards its neighbour in the panel.
        if let Some(c) = culprit.filter(|_| z == cz) {
            let local = c % per_slice;
            let at = (local % x_n, (local / x_n) % y_n);
            link_line(&mut s, (ox, oy + 18.0), cell, at, &link);
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The culprit's link at fault in a torus panel whose first cell is at `origin`: a line from
/// the culprit's cell `at` towards its neighbour along the link (x and y links only).
fn link_line(s: &mut String, origin: (f64, f64), cell: f64, at: (u32, u32), link: &str) {
    let (dx, dy) = match link {
        "ici+x" => (1.0, 0.0),
        "ici-x" => (-1.0, 0.0),
        "ici+y" => (0.0, 1.0),
        "ici-y" => (0.0, -1.0),
        _ => return,
    };
    let (cx, cy) = (
        origin.0 + (f64::from(at.0) + 0.5) * cell,
        origin.1 + (f64::from(at.1) + 0.5) * cell,
    );
    let _ = writeln!(
        s,
        "<line x1=\"{cx:.1}\" y1=\"{cy:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#000\" stroke-width=\"2\"/>",
        cx + dx * cell,
        cy + dy * cell
    );
}

fn status_badge(status: &str) -> String {
    let class = if status == "ok" { "ok" } else { "bad" };
    format!("<span class=\"status {class}\">{}</span>", esc(status))
}

/// The page of one job, from its `report.json`.
pub fn render_report(r: &Value) -> String {
    let mut b = String::new();
    header_section(&mut b, r);
    diagnosis_section(&mut b, r);
    training_section(&mut b, r);
    torch_section(&mut b, r);
    timelines_section(&mut b, r);
    collectives_section(&mut b, r);
    stragglers_section(&mut b, r);
    correctness_section(&mut b, r);
    let _ = writeln!(
        b,
        "<p class=\"muted\">podsim {} &middot; drawn from report.json</p>",
        esc(&text(&r["podsim_version"]))
    );
    page(&format!("podsim: {}", text(&r["job"]["name"])), &b)
}

/// The title line: job, topology, workers, totals, and an error that is not a hang.
fn header_section(b: &mut String, r: &Value) {
    let job = &r["job"];
    let topo = &r["topology"];
    let hw = &topo["hardware"];
    let _ = writeln!(
        b,
        "<h1>{} {}</h1>\n<p>{} job in {} mode from <code>{}</code> on a {} torus of {} chips ({}, {} slice{}), {} worker{}.{}</p>",
        esc(&text(&job["name"])),
        status_badge(&text(&r["status"])),
        esc(&text(&job["kind"])),
        esc(&text(&job["mode"])),
        esc(&text(&job["config"])),
        esc(&text(&topo["shape"])),
        text(&topo["chips"]),
        esc(&text(&hw["name"])),
        text(&topo["slices"]),
        if num(&topo["slices"]) == 1.0 { "" } else { "s" },
        r["workers"].as_array().map_or(0, Vec::len),
        if r["workers"].as_array().map_or(0, Vec::len) == 1 {
            ""
        } else {
            "s"
        },
        // A job that did not finish has no totals.
        if num(&r["wall_s"]) > 0.0 {
            format!(
                " Virtual time {} ms, wall {} s.",
                short(num(&r["virtual_s"]) * 1e3),
                short(num(&r["wall_s"]))
            )
        } else {
            String::new()
        }
    );
    if let Some(e) = r["error"].as_str()
        && r["hang"].is_null()
    {
        let _ = writeln!(b, "<p class=\"diag\">{}</p>", esc(e));
    }
}

/// A hang's diagnosis and the torus picture of the culprit and the waiting chips.
fn diagnosis_section(b: &mut String, r: &Value) {
    let hang = &r["hang"];
    if !hang.is_null() {
        let kind = text(&hang["kind"]).to_uppercase();
        let _ = writeln!(
            b,
            "<h2>Diagnosis</h2>\n<p class=\"diag\"><b>{}</b> detected after {} ms: {}</p>",
            esc(&kind),
            short(num(&hang["detected_after_ms"])),
            esc(&text(&hang["explanation"]))
        );
        let _ = writeln!(
            b,
            "<p>{} chips waiting. Flight recorders: {}.</p>",
            text(&hang["waiting_count"]),
            esc(&hang["flight_recorders"]
                .as_array()
                .map(|a| a.iter().map(text).collect::<Vec<_>>().join(", "))
                .unwrap_or_default())
        );
        if let Some(stack) = hang["culprit"]["python_stack"].as_array() {
            let frames: Vec<String> = stack.iter().map(|f| esc(&text(f))).collect();
            let _ = writeln!(
                b,
                "<p>The culprit rank's Python stack, innermost last:</p>\n<pre>{}</pre>",
                frames.join("\n")
            );
        }
        b.push_str(&legend(&[
            (EXPOSED, "culprit"),
            (HIDDEN, "waiting"),
            (IDLE, "other chips"),
            ("#000", &format!("link {}", text(&hang["culprit"]["link"]))),
        ]));
        b.push_str(&torus_picture(r, hang));
    }
}

/// Training: the summary line, step times by step, HBM by kind.
fn training_section(b: &mut String, r: &Value) {
    let t = &r["training"];
    if !t.is_null() {
        let _ = writeln!(
            b,
            "<h2>Training</h2>\n<p>{} ({} mode): {}, {} parameters, global batch {}. Step {} ms (compute {} ms{}, exposed communication {} ms), MFU {}%. Peak HBM {} of {}.{}</p>",
            esc(&text(&t["strategy"])),
            esc(&text(&t["eager"])),
            esc(&describe_model(&t["model"])),
            text(&t["parameters"]),
            text(&t["global_batch"]),
            short(num(&t["step_ms"])),
            short(num(&t["compute_ms"])),
            match num(&t["hbm_wait_ms"]) {
                ms if ms >= 0.0005 => format!(
                    ", {} ms of it waiting for HBM beside communication",
                    short(ms)
                ),
                _ => String::new(),
            },
            short(num(&t["exposed_comm_ms"])),
            short(num(&t["mfu"]) * 100.0),
            size(num(&t["peak_hbm_bytes"])),
            size(num(&t["hbm_capacity_bytes"])),
            t["oom"]
                .as_str()
                .map(|o| format!(" <b>Does not fit:</b> {}", esc(o)))
                .unwrap_or_default()
        );
        let steps = t["steps"].as_array().cloned().unwrap_or_default();
        let cats: Vec<String> = steps.iter().map(|s| text(&s["step"])).collect();
        let compute: Vec<f64> = steps.iter().map(|s| num(&s["compute_ms"])).collect();
        let exposed: Vec<f64> = steps.iter().map(|s| num(&s["exposed_comm_ms"])).collect();
        let hidden: Vec<f64> = steps
            .iter()
            .map(|s| (num(&s["comm_ms"]) - num(&s["exposed_comm_ms"])).max(0.0))
            .collect();
        b.push_str("<h2>Step time by step</h2>\n<p class=\"muted\">Slowest chip of each step. Compute and exposed communication add up to the step; hidden communication ran under compute and is stacked on top for scale.</p>\n");
        b.push_str(&legend(&[
            (COMPUTE, "compute"),
            (EXPOSED, "exposed communication"),
            (HIDDEN, "hidden communication"),
        ]));
        b.push_str(&stacked_bars(
            &cats,
            &[
                ("compute", COMPUTE, compute),
                ("exposed communication", EXPOSED, exposed),
                ("hidden communication", HIDDEN, hidden),
            ],
            "ms",
        ));
        hbm_section(b, t);
    }
}

/// One step of the traced chips, slice by slice.
fn timelines_section(b: &mut String, r: &Value) {
    if let Some(timelines) = r["timelines"].as_array()
        && !timelines.is_empty()
    {
        b.push_str("<h2>One step, slice by slice</h2>\n");
        b.push_str(&legend(&[
            (COMPUTE, "kernel"),
            (COLLECTIVE, "collective"),
            (PHASE, "algorithm phase"),
            (OTHER, "host transfer"),
        ]));
        for tl in timelines {
            let _ = writeln!(
                b,
                "<p>Chip {}, {} ({} ms{}):</p>",
                text(&tl["chip"]),
                esc(&text(&tl["step"])),
                short(num(&tl["virtual_ms"])),
                match tl["slices_left_out"].as_u64() {
                    Some(n) if n > 0 => format!(", {n} slices left out"),
                    _ => String::new(),
                }
            );
            b.push_str(&gantt(tl));
        }
    }
}

/// A collectives job: bus bandwidth against the injection bound, and the table.
fn collectives_section(b: &mut String, r: &Value) {
    let topo = &r["topology"];
    let hw = &topo["hardware"];
    if let Some(cs) = r["collectives"].as_array()
        && !cs.is_empty()
    {
        // The most a chip can push: every ICI link of the torus out of it at once.
        let axes = dims(&text(&topo["shape"])).len() as f64;
        let bound = 2.0 * axes * num(&hw["ici_bandwidth"]) / 1e9;
        b.push_str("<h2>Collectives: virtual bus bandwidth</h2>\n<p class=\"muted\">nccl-tests' busbw from the mean virtual time of each collective, against the chip's ICI injection bandwidth (every outgoing link of the torus at once).</p>\n");
        b.push_str(&bandwidth(cs, bound));
        b.push_str("<table><tr><th>#</th><th>op</th><th>bytes</th><th>algo</th><th>group</th><th class=\"num\">virtual us</th><th class=\"num\">wall us</th><th class=\"num\">busbw GB/s</th></tr>\n");
        for c in cs {
            let calls = c["calls"].as_array().cloned().unwrap_or_default();
            let n = calls.len().max(1) as f64;
            let mean = |k: &str| calls.iter().map(|x| num(&x[k])).sum::<f64>() / n * 1e6;
            let _ = writeln!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                text(&c["step"]),
                esc(&text(&c["op"])),
                size(num(&c["bytes"])),
                esc(&text(&c["algo"])),
                esc(&text(&c["group"])),
                short(mean("virtual_s")),
                short(mean("wall_s")),
                short(num(&c["virtual_busbw_gbps"]))
            );
        }
        b.push_str("</table>\n");
    }
}

/// A PyTorch program: its steps as the slowest rank saw them, and each rank's collectives.
/// Each step's peak HBM (the fullest rank's, counted at torch's dispatcher) by kind, and its
/// model and hardware flops utilisation.
fn torch_hbm_table(b: &mut String, steps: &[Value]) {
    if steps.iter().all(|s| num(&s["peak_hbm_bytes"]) == 0.0) {
        return;
    }
    let gib = |v: &Value| short(num(v) / (1u64 << 30) as f64);
    b.push_str("<h2>HBM by step</h2>\n<table><tr><th>step</th><th class=\"num\">peak GiB</th><th>at the peak, GiB</th><th class=\"num\">MFU</th><th class=\"num\">HFU</th></tr>\n");
    for s in steps {
        let kinds: Vec<String> = s["hbm_by_kind"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|k| format!("{} {}", text(&k[0]), gib(&k[1])))
            .collect();
        let _ = writeln!(
            b,
            "<tr><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}%</td><td class=\"num\">{}%</td></tr>",
            text(&s["step"]),
            gib(&s["peak_hbm_bytes"]),
            esc(&kinds.join(", ")),
            short(100.0 * num(&s["mfu"])),
            short(100.0 * num(&s["hfu"]))
        );
    }
    b.push_str("</table>\n");
}

fn torch_section(b: &mut String, r: &Value) {
    let t = &r["torch"];
    if t.is_null() {
        return;
    }
    let _ = writeln!(
        b,
        "<h2>PyTorch program</h2>\n<p><code>{}</code></p>",
        esc(&t["command"]
            .as_array()
            .map(|a| a.iter().map(text).collect::<Vec<_>>().join(" "))
            .unwrap_or_default())
    );
    let steps = t["steps"].as_array().cloned().unwrap_or_default();
    if !steps.is_empty() {
        let cats: Vec<String> = steps.iter().map(|s| text(&s["step"])).collect();
        let compute: Vec<f64> = steps.iter().map(|s| num(&s["compute_ms"])).collect();
        let exposed: Vec<f64> = steps.iter().map(|s| num(&s["exposed_comm_ms"])).collect();
        b.push_str("<h2>Step time by step</h2>\n<p class=\"muted\">Each step (ended by <code>optimizer.step()</code> or <code>podsim.torch.step()</code>), as its slowest rank spent it in virtual time: compute counted at torch's dispatcher, then the collectives it waited for.</p>\n");
        b.push_str(&legend(&[
            (COMPUTE, "compute"),
            (EXPOSED, "exposed communication"),
        ]));
        b.push_str(&stacked_bars(
            &cats,
            &[
                ("compute", COMPUTE, compute),
                ("exposed communication", EXPOSED, exposed),
            ],
            "ms",
        ));
        torch_hbm_table(b, &steps);
    }
    b.push_str("<table><tr><th>rank</th><th>exit</th><th class=\"num\">virtual ms</th><th class=\"num\">compute ms</th><th class=\"num\">communication ms</th><th>collectives (calls)</th></tr>\n");
    for rank in t["ranks"].as_array().into_iter().flatten() {
        let ops: Vec<String> = rank["collectives"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{} ({})", text(&c["op"]), text(&c["calls"])))
            .collect();
        let _ = writeln!(
            b,
            "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            text(&rank["rank"]),
            esc(&text(&rank["exit"])),
            short(num(&rank["virtual_ns"]) / 1e6),
            short(num(&rank["compute_ns"]) / 1e6),
            short(num(&rank["comm_ns"]) / 1e6),
            esc(&ops.join(", "))
        );
    }
    b.push_str("</table>\n");
}

/// Chips that held their peers up.
fn stragglers_section(b: &mut String, r: &Value) {
    if let Some(st) = r["stragglers"].as_array()
        && !st.is_empty()
    {
        b.push_str("<h2>Stragglers</h2>\n<table><tr><th>chip</th><th class=\"num\">held peers up, ms</th><th class=\"num\">slowdown</th></tr>\n");
        for s in st {
            let _ = writeln!(
                b,
                "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}x</td></tr>",
                text(&s["chip"]),
                short(num(&s["waited_on_ms"])),
                short(num(&s["slowdown"]))
            );
        }
        b.push_str("</table>\n");
    }
}

/// What was checked and how it compared.
fn correctness_section(b: &mut String, r: &Value) {
    let c = &r["correctness"];
    let _ = writeln!(
        b,
        "<h2>Correctness</h2>\n<p>{} elements checked, {} wrong{}{}.</p>",
        text(&c["elements_checked"]),
        text(&c["wrong_elements"]),
        c["max_abs_diff"]
            .as_f64()
            .map(|d| format!(
                "; against single-chip training on the global batch, max |diff| {d:.3e}"
            ))
            .unwrap_or_default(),
        c["replicas_identical"]
            .as_bool()
            .map(|s| format!("; replicas identical: {s}"))
            .unwrap_or_default()
    );
}

/// A model as `kind key value, ...` (the config's own keys).
fn describe_model(m: &Value) -> String {
    let Some(obj) = m.as_object() else {
        return text(m);
    };
    let rest: Vec<String> = obj
        .iter()
        .filter(|(k, _)| k.as_str() != "kind")
        .map(|(k, v)| match v {
            Value::Array(a) => format!("{k} {}", a.iter().map(text).collect::<Vec<_>>().join("-")),
            v => format!("{k} {}", text(v)),
        })
        .collect();
    format!("{} ({})", text(&m["kind"]), rest.join(", "))
}

/// The largest power-of-1024 unit that keeps `max` bytes at 1 or more.
fn byte_unit(max: f64) -> (&'static str, f64) {
    [("GiB", 30), ("MiB", 20), ("KiB", 10)]
        .into_iter()
        .map(|(u, p)| (u, (1u64 << p) as f64))
        .find(|&(_, d)| max >= d)
        .unwrap_or(("B", 1.0))
}

/// HBM at its peak per chip, by kind (the chips with the largest peaks when there are many).
fn hbm_section(b: &mut String, t: &Value) {
    let all = t["hbm"].as_array().cloned().unwrap_or_default();
    if all.is_empty() {
        return;
    }
    // Chips with the same peaks share one bar.
    let mut alike: Vec<(Value, usize)> = Vec::new();
    for c in all {
        match alike
            .iter_mut()
            .find(|(a, _)| a["peak_by_kind"] == c["peak_by_kind"])
        {
            Some((_, n)) => *n += 1,
            None => alike.push((c, 1)),
        }
    }
    let total = alike.len();
    alike.sort_by(|a, b| num(&b.0["peak_bytes"]).total_cmp(&num(&a.0["peak_bytes"])));
    alike.truncate(32);
    alike.sort_by_key(|c| c.0["chip"].as_u64());
    let chips: Vec<Value> = alike.iter().map(|(c, _)| c.clone()).collect();
    let kinds = [
        ("params", COMPUTE),
        ("grads", COLLECTIVE),
        ("optimizer", PHASE),
        ("activations", EXPOSED),
        ("transient", HIDDEN),
    ];
    let max = chips
        .iter()
        .map(|c| {
            kinds
                .iter()
                .map(|(k, _)| num(&c["peak_by_kind"][*k]))
                .sum::<f64>()
        })
        .fold(0.0, f64::max);
    let (unit, div) = byte_unit(max);
    let _ = writeln!(
        b,
        "<h2>HBM per chip</h2>\n<p class=\"muted\">Each kind at its own peak, {unit}; chips with the same peaks share a bar{}. The capacity is {}.</p>",
        if total > chips.len() {
            format!(
                " ({} of {total} different bars: those with the largest peaks)",
                chips.len()
            )
        } else {
            String::new()
        },
        size(num(&t["hbm_capacity_bytes"]))
    );
    b.push_str(&legend(&kinds.map(|(k, c)| (c, k))));
    let cats: Vec<String> = alike
        .iter()
        .map(|(c, n)| match n {
            1 => format!("chip {}", text(&c["chip"])),
            n => format!("chip {} and {} alike", text(&c["chip"]), n - 1),
        })
        .collect();
    let series: Vec<(&str, &str, Vec<f64>)> = kinds
        .iter()
        .map(|&(k, colour)| {
            (
                k,
                colour,
                chips
                    .iter()
                    .map(|c| num(&c["peak_by_kind"][k]) / div)
                    .collect(),
            )
        })
        .collect();
    b.push_str(&stacked_bars(&cats, &series, unit));
}

/// The page of a study: its plots (the SVG files it wrote) and its results table.
pub fn render_study(name: &str, plots: &[(String, String)], csv: &str) -> String {
    let mut b = format!("<h1>Study {}</h1>\n", esc(name));
    for (file, svg) in plots {
        let _ = writeln!(b, "<h2>{}</h2>", esc(file));
        // The plot's own SVG, without its XML declaration.
        let body = svg.find("<svg").map_or(svg.as_str(), |i| &svg[i..]);
        b.push_str(body);
        b.push('\n');
    }
    b.push_str("<h2>Results</h2>\n<table>\n");
    for (i, (_, record)) in crate::csv::csv_records(csv, false).iter().enumerate() {
        let tag = if i == 0 { "th" } else { "td" };
        b.push_str("<tr>");
        for cell in crate::csv::csv_cells(record) {
            let _ = write!(b, "<{tag}>{}</{tag}>", esc(&cell));
        }
        b.push_str("</tr>\n");
    }
    b.push_str("</table>\n");
    page(&format!("podsim study: {name}"), &b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">&</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;"
        );
    }

    #[test]
    fn waiting_ranges_are_searched_inclusive() {
        let r = [(2, 4), (10, 10)];
        let hits: Vec<u32> = (0..12).filter(|&c| in_ranges(&r, c)).collect();
        assert_eq!(hits, vec![2, 3, 4, 10]);
    }
}
