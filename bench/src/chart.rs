//! The report's chart: one horizontal bar per ratio (rdmsg / anchor), the goal as a tick, drawn
//! into an RGB raster with a built-in 5×7 font and written as PNG.

use std::io::Write;

use anyhow::{Context, Result};

use crate::report::{fmt_num, Goal, Row};

type Rgb = [u8; 3];
const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [30, 30, 30];
const GRID: Rgb = [215, 215, 215];
const PARITY: Rgb = [120, 120, 120];
const MET: Rgb = [60, 160, 90];
const MISSED: Rgb = [205, 60, 50];
const NO_GOAL: Rgb = [80, 120, 180];

/// Pixels per font pixel.
const SCALE: usize = 2;
const GLYPH_W: usize = 5;
const GLYPH_H: usize = 7;
const ADVANCE: usize = (GLYPH_W + 1) * SCALE;
const ROW_H: usize = 22;
const SECTION_GAP: usize = 10;
const MARGIN: usize = 20;
const PLOT_W: usize = 640;

/// A 5×7 font: each glyph is seven rows of five pixels, `#` set.
const GLYPHS: &[(char, &str)] = &[
    ('A', ".###. #...# #...# ##### #...# #...# #...#"),
    ('B', "####. #...# #...# ####. #...# #...# ####."),
    ('C', ".###. #...# #.... #.... #.... #...# .###."),
    ('D', "####. #...# #...# #...# #...# #...# ####."),
    ('E', "##### #.... #.... ####. #.... #.... #####"),
    ('F', "##### #.... #.... ####. #.... #.... #...."),
    ('G', ".###. #...# #.... #.### #...# #...# .####"),
    ('H', "#...# #...# #...# ##### #...# #...# #...#"),
    ('I', ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('J', "..### ...#. ...#. ...#. ...#. #..#. .##.."),
    ('K', "#...# #..#. #.#.. ##... #.#.. #..#. #...#"),
    ('L', "#.... #.... #.... #.... #.... #.... #####"),
    ('M', "#...# ##.## #.#.# #.#.# #...# #...# #...#"),
    ('N', "#...# #...# ##..# #.#.# #..## #...# #...#"),
    ('O', ".###. #...# #...# #...# #...# #...# .###."),
    ('P', "####. #...# #...# ####. #.... #.... #...."),
    ('Q', ".###. #...# #...# #...# #.#.# #..#. .##.#"),
    ('R', "####. #...# #...# ####. #.#.. #..#. #...#"),
    ('S', ".#### #.... #.... .###. ....# ....# ####."),
    ('T', "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."),
    ('U', "#...# #...# #...# #...# #...# #...# .###."),
    ('V', "#...# #...# #...# #...# #...# .#.#. ..#.."),
    ('W', "#...# #...# #...# #.#.# #.#.# #.#.# .#.#."),
    ('X', "#...# #...# .#.#. ..#.. .#.#. #...# #...#"),
    ('Y', "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.."),
    ('Z', "##### ....# ...#. ..#.. .#... #.... #####"),
    ('0', ".###. #...# #..## #.#.# ##..# #...# .###."),
    ('1', "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('2', ".###. #...# ....# ...#. ..#.. .#... #####"),
    ('3', "##### ...#. ..#.. ...#. ....# #...# .###."),
    ('4', "...#. ..##. .#.#. #..#. ##### ...#. ...#."),
    ('5', "##### #.... ####. ....# ....# #...# .###."),
    ('6', "..##. .#... #.... ####. #...# #...# .###."),
    ('7', "##### ....# ...#. ..#.. .#... .#... .#..."),
    ('8', ".###. #...# #...# .###. #...# #...# .###."),
    ('9', ".###. #...# #...# .#### ....# ...#. .##.."),
    (' ', "..... ..... ..... ..... ..... ..... ....."),
    ('.', "..... ..... ..... ..... ..... .##.. .##.."),
    (',', "..... ..... ..... ..... .##.. ..#.. .#..."),
    ('-', "..... ..... ..... ##### ..... ..... ....."),
    ('/', "..... ....# ...#. ..#.. .#... #.... ....."),
    ('(', "...#. ..#.. .#... .#... .#... ..#.. ...#."),
    (')', ".#... ..#.. ...#. ...#. ...#. ..#.. .#..."),
    ('=', "..... ..... ##### ..... ##### ..... ....."),
    (':', "..... .##.. .##.. ..... .##.. .##.. ....."),
    ('%', "##... ##..# ...#. ..#.. .#... #..## ...##"),
    ('+', "..... ..#.. ..#.. ##### ..#.. ..#.. ....."),
    ('<', "...#. ..#.. .#... #.... .#... ..#.. ...#."),
    ('>', ".#... ..#.. ...#. ....# ...#. ..#.. .#..."),
    ('|', "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."),
    ('?', ".###. #...# ....# ...#. ..#.. ..... ..#.."),
];

fn glyph(c: char) -> &'static str {
    let c = match c {
        '×' => 'X',
        '≤' => '<',
        '≥' => '>',
        'µ' => 'U',
        c => c.to_ascii_uppercase(),
    };
    GLYPHS
        .iter()
        .find(|(g, _)| *g == c)
        .or_else(|| GLYPHS.iter().find(|(g, _)| *g == '?'))
        .map_or("", |(_, rows)| rows)
}

/// An RGB raster.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self {
            w,
            h,
            px: WHITE.repeat(w * h),
        }
    }

    fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, color: Rgb) {
        for yy in y..(y + h).min(self.h) {
            for xx in x..(x + w).min(self.w) {
                let i = (yy * self.w + xx) * 3;
                self.px[i..i + 3].copy_from_slice(&color);
            }
        }
    }

    fn text(&mut self, x: usize, y: usize, s: &str, color: Rgb) {
        for (n, c) in s.chars().enumerate() {
            let x0 = x + n * ADVANCE;
            for (row, bits) in glyph(c).split(' ').take(GLYPH_H).enumerate() {
                for (col, b) in bits.bytes().enumerate() {
                    if b == b'#' {
                        self.rect(x0 + col * SCALE, y + row * SCALE, SCALE, SCALE, color);
                    }
                }
            }
        }
    }
}

fn text_width(s: &str) -> usize {
    s.chars().count() * ADVANCE
}

/// Draws the rows that have a ratio and writes the PNG to `out`. Returns how many bars.
pub fn write_png(rows: &[Row], title: &str, out: impl Write) -> Result<usize> {
    let bars: Vec<(&Row, String, f64)> = rows
        .iter()
        .filter_map(|r| {
            let ratio = r.ratio.filter(|x| x.is_finite())?;
            Some((r, format!("{} {}", r.section.short(), r.label), ratio))
        })
        .collect();
    let max_ratio = bars.iter().map(|b| b.2).fold(1.0, f64::max);
    let x_max = ((max_ratio * 2.0).ceil() / 2.0).clamp(1.5, 3.0);
    let label_w = bars.iter().map(|b| text_width(&b.1)).max().unwrap_or(0) + ADVANCE;
    let sections = {
        let mut s: Vec<_> = bars.iter().map(|b| b.0.section).collect();
        s.dedup();
        s.len()
    };
    let plot_x = MARGIN + label_w;
    let top = MARGIN + 3 * ROW_H;
    let width = plot_x + PLOT_W + text_width(" 3.00X MISSED") + MARGIN;
    let height = top + bars.len() * ROW_H + sections * SECTION_GAP + MARGIN;
    let mut c = Canvas::new(width, height);
    let scale = |ratio: f64| (ratio.clamp(0.0, x_max) / x_max * PLOT_W as f64) as usize;

    c.text(MARGIN, MARGIN, title, INK);
    c.text(
        MARGIN,
        MARGIN + ROW_H,
        "bars: rdmsg / anchor, same run.  green: goal met  red: missed  blue: no goal  |: goal",
        INK,
    );
    let mut tick = 0.0;
    while tick <= x_max + 1e-9 {
        let x = plot_x + scale(tick);
        let color = if (tick - 1.0).abs() < 1e-9 {
            PARITY
        } else {
            GRID
        };
        c.rect(
            x,
            top - 4,
            1 + usize::from(color == PARITY),
            height - top - MARGIN + 4,
            color,
        );
        let label = format!("{tick:.1}");
        c.text(
            x.saturating_sub(text_width(&label) / 2),
            top - 4 - ROW_H + 4,
            &label,
            INK,
        );
        tick += 0.5;
    }
    let mut y = top;
    let mut section = None;
    for (row, label, ratio) in &bars {
        if section != Some(row.section) {
            if section.is_some() {
                y += SECTION_GAP;
            }
            section = Some(row.section);
        }
        let color = match row.met {
            Some(true) => MET,
            Some(false) => MISSED,
            None => NO_GOAL,
        };
        c.text(MARGIN, y + 4, label, INK);
        let w = scale(*ratio).max(1);
        c.rect(plot_x, y + 3, w, ROW_H - 6, color);
        if let Some(goal) = row.goal {
            let g = match goal {
                Goal::AtMost(g) | Goal::AtLeast(g) => g,
            };
            c.rect(plot_x + scale(g), y + 1, 3, ROW_H - 2, INK);
        }
        let clipped = if *ratio > x_max { ">" } else { "" };
        c.text(
            plot_x + w + ADVANCE,
            y + 4,
            &format!("{clipped}{}X", fmt_num(*ratio)),
            INK,
        );
        y += ROW_H;
    }

    let mut encoder = png::Encoder::new(out, width as u32, height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().context("writing the PNG header")?;
    writer
        .write_image_data(&c.px)
        .context("writing the PNG image")?;
    writer.finish().context("finishing the PNG")?;
    Ok(bars.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Section;

    #[test]
    fn every_glyph_is_seven_rows_of_five() {
        for (c, rows) in GLYPHS {
            let rows: Vec<&str> = rows.split(' ').collect();
            assert_eq!(rows.len(), GLYPH_H, "{c:?}");
            assert!(rows.iter().all(|r| r.len() == GLYPH_W), "{c:?}");
        }
        assert_eq!(glyph('a'), glyph('A'));
        assert_eq!(glyph('~'), glyph('?'));
    }

    #[test]
    fn writes_a_png() {
        let row = Row {
            section: Section::LatencyEvent,
            label: "8 B".into(),
            ours: 110.0,
            anchor_name: Some("ib_send_lat -e".into()),
            anchor: Some(100.0),
            ratio: Some(1.1),
            goal: Some(Goal::AtMost(1.15)),
            met: Some(true),
            rounds: 3,
        };
        let mut png = Vec::new();
        let bars = write_png(&[row.clone(), Row { ratio: None, ..row }], "test", &mut png).unwrap();
        assert_eq!(bars, 1);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let info = decoder.read_info().unwrap().info().clone();
        assert!(info.width > 600 && info.height > 100);
    }
}
