package bench

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strconv"
)

// Chart geometry, in SVG user units (pixels).
const (
	panelW, panelH = 460, 300
	marginL        = 56
	marginR        = 12
	marginT        = 36
	marginB        = 40
	legendW        = 250 // at least
	legendLineH    = 16
	legendTextX    = 34 // from the legend's left edge
	titleH         = 30
)

// palette colours the series (colour-blind-safe Okabe–Ito order).
var palette = []string{"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"}

// series is one line of a panel.
type series struct {
	name   string
	dashed bool
	colour string
	pts    map[int]float64 // jobs → GB/s
}

// WriteSVG draws throughput against concurrency: one panel per key size and
// checksum setting, one solid line per path and direction, and the
// ceilings the runs were held against as dashed lines of the same
// direction's colour. It writes a self-contained SVG document.
func (r *Report) WriteSVG(w io.Writer) error {
	var panels []string
	for _, x := range r.Runs {
		if !slices.Contains(panels, x.panelKey()) {
			panels = append(panels, x.panelKey())
		}
	}
	colours := map[string]string{}
	colourOf := func(key string) string {
		if c, ok := colours[key]; ok {
			return c
		}
		c := palette[len(colours)%len(palette)]
		colours[key] = c
		return c
	}
	// Assign colours in run order so that every panel agrees.
	for _, x := range r.Runs {
		colourOf(x.seriesKey())
		colourOf("ceiling " + x.Direction + " " + x.Ceiling.Name)
	}
	cols := min(2, max(1, len(panels)))
	rows := (len(panels) + cols - 1) / cols
	// The legend lists every series of every panel: as wide as its
	// longest name and as tall as its lines need.
	var names []string
	for _, x := range r.Runs {
		names = append(names, x.seriesKey())
		if x.Ceiling.GBps > 0 {
			names = append(names, "ceiling "+x.Direction+" "+x.Ceiling.Name)
		}
	}
	slices.Sort(names)
	names = slices.Compact(names)
	lw := legendW
	for _, n := range names {
		lw = max(lw, legendTextX+textWidth(n)+marginR)
	}
	width := cols*panelW + lw
	height := max(titleH+max(1, rows)*panelH, titleH+marginT+len(names)*legendLineH)
	bw := bufio.NewWriter(w)
	p := func(format string, args ...any) { fmt.Fprintf(bw, format, args...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n", width, height, width, height)
	p(`<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	p(`<text x="10" y="20" font-size="14" font-weight="bold">%s</text>`+"\n", esc(r.title()))
	legend := map[string]series{}
	var legendOrder []string
	for i, panel := range panels {
		ox, oy := (i%cols)*panelW, titleH+(i/cols)*panelH
		var ss []*series
		byName := map[string]*series{}
		add := func(name string, dashed bool, colour string, jobs int, v float64) {
			s, ok := byName[name]
			if !ok {
				s = &series{name: name, dashed: dashed, colour: colour, pts: map[int]float64{}}
				byName[name] = s
				ss = append(ss, s)
			}
			s.pts[jobs] = v
		}
		var jobs []int
		for _, x := range r.Runs {
			if x.panelKey() != panel {
				continue
			}
			if !slices.Contains(jobs, x.Jobs) {
				jobs = append(jobs, x.Jobs)
			}
			add(x.seriesKey(), false, colourOf(x.seriesKey()), x.Jobs, x.GBps)
			if x.Ceiling.GBps > 0 {
				ck := "ceiling " + x.Direction + " " + x.Ceiling.Name
				add(ck, true, colourOf(ck), x.Jobs, x.Ceiling.GBps)
			}
		}
		slices.Sort(jobs)
		ymax := 0.0
		for _, s := range ss {
			for _, v := range s.pts {
				ymax = max(ymax, v)
			}
			if _, ok := legend[s.name]; !ok {
				legend[s.name] = *s
				legendOrder = append(legendOrder, s.name)
			}
		}
		writePanel(p, ox, oy, panel, jobs, niceMax(ymax), ss)
	}
	// Legend.
	lx := cols * panelW
	for i, name := range legendOrder {
		s := legend[name]
		y := titleH + marginT + i*legendLineH
		dash := ""
		if s.dashed {
			dash = ` stroke-dasharray="5,3"`
		}
		p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", lx+4, y-4, lx+28, y-4, s.colour, dash)
		p(`<text x="%d" y="%d">%s</text>`+"\n", lx+legendTextX, y, esc(name))
	}
	p("</svg>\n")
	return bw.Flush()
}

// textWidth is an upper bound of the width of s at the chart's 11-unit
// sans-serif font: 0.65 em a character, wider than any Latin glyph but W
// and M on average.
func textWidth(s string) int {
	return int(math.Ceil(float64(len([]rune(s))) * 11 * 0.65))
}

// writePanel draws one panel's axes, grid and lines; x positions are the
// distinct job counts, evenly spaced.
func writePanel(p func(string, ...any), ox, oy int, title string, jobs []int, ymax float64, ss []*series) {
	x0, y0 := ox+marginL, oy+panelH-marginB
	pw, ph := panelW-marginL-marginR, panelH-marginT-marginB
	p(`<text x="%d" y="%d" font-size="12" font-weight="bold">%s</text>`+"\n", x0, oy+marginT-12, esc(title))
	xOf := func(j int) float64 {
		i := slices.Index(jobs, j)
		if len(jobs) == 1 {
			return float64(x0) + float64(pw)/2
		}
		return float64(x0) + float64(i)*float64(pw)/float64(len(jobs)-1)
	}
	yOf := func(v float64) float64 { return float64(y0) - v/ymax*float64(ph) }
	// Grid and y labels.
	for k := 0; k <= 5; k++ {
		v := ymax * float64(k) / 5
		y := yOf(v)
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", x0, y, x0+pw, y)
		p(`<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", x0-4, y+4, strconv.FormatFloat(v, 'g', 3, 64))
	}
	p(`<text x="%d" y="%d" transform="rotate(-90 %d %d)" text-anchor="middle">GB/s</text>`+"\n", ox+14, oy+marginT+ph/2, ox+14, oy+marginT+ph/2)
	for _, j := range jobs {
		p(`<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", xOf(j), y0+14, j)
	}
	p(`<text x="%d" y="%d" text-anchor="middle">concurrent jobs</text>`+"\n", x0+pw/2, y0+30)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, y0, x0+pw, y0)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, y0, x0, y0-ph)
	for _, s := range ss {
		var pts []byte
		for _, j := range jobs {
			v, ok := s.pts[j]
			if !ok {
				continue
			}
			pts = fmt.Appendf(pts, "%.1f,%.1f ", xOf(j), yOf(v))
		}
		dash := ""
		if s.dashed {
			dash = ` stroke-dasharray="5,3"`
		}
		p(`<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s><title>%s</title></polyline>`+"\n", pts, s.colour, dash, esc(s.name))
		if !s.dashed {
			for _, j := range jobs {
				if v, ok := s.pts[j]; ok {
					p(`<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s, %d jobs: %.2f GB/s</title></circle>`+"\n", xOf(j), yOf(v), s.colour, esc(s.name), j, v)
				}
			}
		}
	}
}

// niceMax rounds v up to 1, 2 or 5 times a power of ten (at least 0.1).
func niceMax(v float64) float64 {
	if v <= 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1
	}
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= v {
			return max(0.1, m*e)
		}
	}
	return 10 * e
}

func esc(s string) string { return html.EscapeString(s) }
