//! A minimal hand-written SVG line chart (axes, ticks, labels, legend), one polyline per series.

use std::fmt::Write;

#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    /// (x, y) points; sorted by x when drawn.
    pub points: Vec<(f64, f64)>,
}

const COLORS: &[&str] = &["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" tick step (1, 2, 5 × 10^k) giving about `n` ticks over `range`.
fn nice_step(range: f64, n: usize) -> f64 {
    if range <= 0.0 || !range.is_finite() {
        return 1.0;
    }
    let raw = range / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn fmt_num(v: f64) -> String {
    if v == v.round() && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{:.0}", v)
    } else if v.abs() >= 1.0 {
        format!("{:.1}", v)
    } else {
        format!("{:.2}", v)
    }
}

/// Render a line chart. With `log2_x` the x axis is log₂-scaled (for concurrency 1/4/16/64) and
/// ticks sit at the data's x values. The y axis starts at 0.
pub fn line_chart(title: &str, xlabel: &str, ylabel: &str, series: &[Series], log2_x: bool) -> String {
    let (w, h) = (760.0, 440.0);
    let (ml, mr, mt, mb) = (75.0, 190.0, 40.0, 55.0);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let pts: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    let log2_x = log2_x && pts.iter().all(|p| p.0 > 0.0);
    let tx = |x: f64| if log2_x { x.log2() } else { x };
    let (mut x0, mut x1) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(tx(p.0)), b.max(tx(p.0))));
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x0 -= 0.5;
        x1 += 0.5;
    }
    let ymax_data = pts.iter().map(|p| p.1).fold(0.0, f64::max);
    let ystep = nice_step(if ymax_data > 0.0 { ymax_data } else { 1.0 }, 5);
    let y1 = ((ymax_data / ystep).ceil().max(1.0)) * ystep;
    let sx = |x: f64| ml + (tx(x) - x0) / (x1 - x0) * pw;
    let sy = |y: f64| mt + ph - (y / y1) * ph;

    let mut o = String::new();
    let _ = writeln!(o, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(o, r#"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#, ml + pw / 2.0, esc(title));
    // y grid + ticks
    let mut y = 0.0;
    while y <= y1 + ystep * 1e-6 {
        let py = sy(y);
        let _ = writeln!(o, r##"<line x1="{ml}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e0e0e0"/>"##, ml + pw);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, ml - 6.0, py + 4.0, fmt_num(y));
        y += ystep;
    }
    // x ticks
    let xticks: Vec<f64> = if log2_x {
        let mut v: Vec<f64> = pts.iter().map(|p| p.0).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v.dedup();
        v
    } else {
        let st = nice_step(x1 - x0, 6);
        let mut v = Vec::new();
        let mut x = (x0 / st).ceil() * st;
        while x <= x1 + st * 1e-6 {
            v.push(x);
            x += st;
        }
        v
    };
    for x in xticks {
        let px = sx(x);
        let _ = writeln!(o, r##"<line x1="{px:.1}" y1="{mt}" x2="{px:.1}" y2="{:.1}" stroke="#f0f0f0"/>"##, mt + ph);
        let _ = writeln!(o, r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, mt + ph + 18.0, fmt_num(x));
    }
    // axes
    let _ = writeln!(o, r#"<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{:.1}" stroke="black"/>"#, mt + ph);
    let _ = writeln!(o, r#"<line x1="{ml}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#, mt + ph, ml + pw, mt + ph);
    let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, ml + pw / 2.0, h - 12.0, esc(xlabel));
    let _ = writeln!(
        o,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
        mt + ph / 2.0,
        mt + ph / 2.0,
        esc(ylabel)
    );
    // series + legend
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut p: Vec<(f64, f64)> = s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        p.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        let poly: Vec<String> = p.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        let _ = writeln!(o, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, poly.join(" "));
        for &(x, y) in &p {
            let _ = writeln!(o, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, sx(x), sy(y));
        }
        let ly = mt + 10.0 + i as f64 * 20.0;
        let lx = ml + pw + 15.0;
        let _ = writeln!(o, r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{c}" stroke-width="2"/>"#, lx + 22.0);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, lx + 28.0, ly + 4.0, esc(&s.name));
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_axes_lines_and_legend() {
        let s = vec![
            Series { name: "base".into(), points: vec![(1.0, 10.0), (4.0, 35.0), (16.0, 90.0), (64.0, 150.0)] },
            Series { name: "4 <adapters>".into(), points: vec![(1.0, 9.0), (64.0, 120.0)] },
        ];
        let svg = line_chart("Throughput", "concurrency", "output tok/s", &s, true);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("4 &lt;adapters&gt;"));
        assert!(svg.contains(">64<") && svg.contains(">150<"));
        assert_eq!(nice_step(150.0, 5), 50.0);
        // empty input still renders
        assert!(line_chart("t", "x", "y", &[], false).contains("</svg>"));
    }
}
