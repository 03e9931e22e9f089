package benchreport

import (
	"fmt"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Plot sizes: 10 x 6 inches at 100 dots per inch, 1000 x 600 pixels before the footer.
const (
	plotWidth  = 10 * vg.Inch
	plotHeight = 6 * vg.Inch
	plotDPI    = 100
)

// palette is Okabe and Ito's, which stays apart for colour-blind readers.
var palette = []color.Color{
	color.RGBA{0, 114, 178, 255},   // blue
	color.RGBA{230, 159, 0, 255},   // orange
	color.RGBA{0, 158, 115, 255},   // green
	color.RGBA{204, 121, 167, 255}, // purple
	color.RGBA{213, 94, 0, 255},    // vermillion
	color.RGBA{86, 180, 233, 255},  // sky blue
	color.RGBA{120, 120, 120, 255}, // grey
}

var (
	grey     = color.RGBA{110, 110, 110, 255}
	red      = color.RGBA{200, 30, 30, 255}
	okGreen  = color.RGBA{60, 160, 90, 255}
	lightRed = color.RGBA{240, 190, 190, 255}
	fitGrey  = color.RGBA{150, 150, 150, 255}
	brown    = color.RGBA{140, 90, 40, 255}
)

var fontOnce sync.Once

// newPlot is a plot with a title, axis labels, a grid and sans-serif text.
func newPlot(title, x, y string) *plot.Plot {
	fontOnce.Do(func() { plot.DefaultFont = font.Font{Typeface: "Liberation", Variant: "Sans"} })
	p := plot.New()
	p.Title.Text = title
	p.Title.TextStyle.Font.Size = vg.Points(14)
	p.Title.Padding = vg.Points(6)
	p.X.Label.Text = x
	p.Y.Label.Text = y
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font.Size = vg.Points(12)
		a.Tick.Label.Font.Size = vg.Points(10.5)
	}
	p.Legend.TextStyle.Font.Size = vg.Points(10.5)
	p.Legend.Top = true
	p.X.Tick.Marker, p.Y.Tick.Marker = cleanTicks{}, cleanTicks{}
	p.Add(plotter.NewGrid())
	return p
}

// cleanTicks are gonum's default ticks labelled without trailing zeros (750, not 750.00).
type cleanTicks struct{}

// Ticks implements plot.Ticker.
func (cleanTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', -1, 64)
		}
	}
	return ts
}

// style describes one series.
type style struct {
	color  color.Color
	dashes []vg.Length
	width  vg.Length
	points bool // draw a marker at each point
	step   bool // a step function (CDFs)
}

var (
	dashed = []vg.Length{vg.Points(6), vg.Points(4)}
	dotted = []vg.Length{vg.Points(2), vg.Points(3)}
)

// addLine adds a series and its legend entry ("" for none).
func addLine(p *plot.Plot, name string, xys plotter.XYs, s style) error {
	if len(xys) == 0 {
		return nil
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		return err
	}
	l.Color = s.color
	l.Dashes = s.dashes
	l.Width = s.width
	if l.Width == 0 {
		l.Width = vg.Points(2)
	}
	if s.step {
		l.StepStyle = plotter.PostStep
	}
	p.Add(l)
	thumbs := []plot.Thumbnailer{l}
	if s.points {
		sc, err := plotter.NewScatter(xys)
		if err != nil {
			return err
		}
		sc.GlyphStyle = draw.GlyphStyle{Color: s.color, Radius: vg.Points(3.5), Shape: draw.CircleGlyph{}}
		p.Add(sc)
		thumbs = append(thumbs, sc)
	}
	if name != "" {
		p.Legend.Add(name, thumbs...)
	}
	return nil
}

// Label offsets: below and right of a point keeps a label off a rising curve.
var (
	belowRight = vg.Point{X: vg.Points(7), Y: vg.Points(-14)}
	aboveRight = vg.Point{X: vg.Points(5), Y: vg.Points(4)}
)

// addLabels writes texts at points, offset from them.
func addLabels(p *plot.Plot, xys plotter.XYs, texts []string, offset vg.Point) error {
	if len(xys) == 0 {
		return nil
	}
	l, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: texts})
	if err != nil {
		return err
	}
	for i := range l.TextStyle {
		l.TextStyle[i].Font = font.Font{Typeface: "Liberation", Variant: "Sans", Size: vg.Points(9.5)}
		l.TextStyle[i].Color = color.RGBA{40, 40, 40, 255}
	}
	l.Offset = offset
	p.Add(l)
	return nil
}

// vline draws a vertical line from y0 to y1 at x.
func vline(p *plot.Plot, name string, x, y0, y1 float64, s style) error {
	return addLine(p, name, plotter.XYs{{X: x, Y: y0}, {X: x, Y: y1}}, s)
}

// logTicks labels a log axis at the given values.
func logTicks(values []float64, label func(float64) string) plot.ConstantTicks {
	var t plot.ConstantTicks
	for _, v := range values {
		t = append(t, plot.Tick{Value: v, Label: label(v)})
	}
	return t
}

// decadeTicks are ticks at 1, 2 and 5 times the powers of ten between lo and hi.
func decadeTicks(lo, hi float64, label func(float64) string) plot.ConstantTicks {
	var t plot.ConstantTicks
	for e := math.Floor(math.Log10(lo)) - 1; e <= math.Ceil(math.Log10(hi))+1; e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if v < lo*0.999 || v > hi*1.001 {
				continue
			}
			t = append(t, plot.Tick{Value: v, Label: label(v)})
		}
	}
	return t
}

// figure is one PNG: a grid of plots and a footer naming the command and the machine.
type figure struct {
	file  string
	plots [][]*plot.Plot
	// height overrides plotHeight.
	height vg.Length
}

// render writes f into dir with footer lines under the plots; fast trades the PNG's size for
// the time to compress it.
func render(dir string, f figure, footer []string, fast bool) error {
	h := plotHeight
	if f.height > 0 {
		h = f.height
	}
	fsty := plot.New().Title.TextStyle
	fsty.Font = font.Font{Typeface: "Liberation", Variant: "Sans", Size: vg.Points(9.5)}
	fsty.Color = color.RGBA{60, 60, 60, 255}
	fsty.XAlign, fsty.YAlign = draw.XLeft, draw.YBottom
	lineH := vg.Points(13)
	footH := vg.Length(len(footer))*lineH + vg.Points(8)
	img := vgimg.NewWith(vgimg.UseWH(plotWidth, h+footH), vgimg.UseDPI(plotDPI))
	dc := draw.New(img)
	area := draw.Crop(dc, 0, 0, footH, 0)
	rows, cols := len(f.plots), len(f.plots[0])
	tiles := draw.Tiles{Rows: rows, Cols: cols, PadX: vg.Points(24), PadY: vg.Points(18),
		PadTop: vg.Points(6), PadBottom: vg.Points(4), PadLeft: vg.Points(8), PadRight: vg.Points(14)}
	canvases := plot.Align(f.plots, tiles, area)
	for i, row := range f.plots {
		for j, p := range row {
			if p != nil {
				p.Draw(canvases[i][j])
			}
		}
	}
	// A rule between the plots and the footer.
	dc.SetColor(color.RGBA{200, 200, 200, 255})
	dc.SetLineWidth(vg.Points(0.7))
	var rule vg.Path
	rule.Move(vg.Point{X: vg.Points(8), Y: footH - vg.Points(2)})
	rule.Line(vg.Point{X: plotWidth - vg.Points(8), Y: footH - vg.Points(2)})
	dc.Stroke(rule)
	for i, line := range footer {
		y := footH - vg.Points(4) - vg.Length(i+1)*lineH
		dc.FillText(fsty, vg.Point{X: vg.Points(10), Y: y + vg.Points(3)}, line)
	}
	out, err := os.Create(filepath.Join(dir, f.file))
	if err != nil {
		return err
	}
	enc := png.Encoder{CompressionLevel: png.DefaultCompression}
	if fast {
		enc.CompressionLevel = png.BestSpeed
	}
	if err := enc.Encode(out, img.Image()); err != nil {
		out.Close()
		return fmt.Errorf("%s: %w", f.file, err)
	}
	return out.Close()
}

// wrap breaks s into lines of at most n characters at spaces.
func wrap(s string, n int) []string {
	var lines []string
	var cur strings.Builder
	for _, w := range strings.Fields(s) {
		if cur.Len() > 0 && cur.Len()+1+len(w) > n {
			lines = append(lines, cur.String())
			cur.Reset()
		}
		if cur.Len() > 0 {
			cur.WriteByte(' ')
		}
		cur.WriteString(w)
	}
	if cur.Len() > 0 {
		lines = append(lines, cur.String())
	}
	return lines
}

// linearFit is the least-squares line through the first n points, and the first point after
// them that is more than tolerance (a fraction) off its extrapolation: where the curve stops
// being linear (-1: nowhere).
func linearFit(xs, ys []float64, n int, tolerance float64) (a, b float64, knee int) {
	knee = -1
	n = min(n, len(xs))
	if n < 2 {
		return 0, 0, knee
	}
	var sx, sy, sxx, sxy float64
	for i := range n {
		sx += xs[i]
		sy += ys[i]
		sxx += xs[i] * xs[i]
		sxy += xs[i] * ys[i]
	}
	fn := float64(n)
	if d := fn*sxx - sx*sx; d != 0 {
		b = (fn*sxy - sx*sy) / d
	}
	a = (sy - b*sx) / fn
	for i := n; i < len(xs); i++ {
		if fit := a + b*xs[i]; fit > 0 && math.Abs(ys[i]/fit-1) > tolerance {
			return a, b, i
		}
	}
	return a, b, knee
}
