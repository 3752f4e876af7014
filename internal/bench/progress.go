package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// IsTerminal reports whether f is a terminal (the progress bar is drawn
// only there).
func IsTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// Progress draws a one-line progress bar, redrawn at most every 100 ms.
// A nil *Progress draws nothing, so callers need no checks.
type Progress struct {
	mu    sync.Mutex
	w     io.Writer
	label string
	done  int
	total int
	last  time.Time
	width int // of the last line, to clear it
}

// NewProgress returns a bar drawing on w, or nil when enabled is false.
func NewProgress(w io.Writer, enabled bool) *Progress {
	if !enabled {
		return nil
	}
	return &Progress{w: w}
}

// Start begins a phase of total steps.
func (p *Progress) Start(label string, total int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.label, p.done, p.total = label, 0, total
	p.drawLocked(true)
	p.mu.Unlock()
}

// Step counts n steps done.
func (p *Progress) Step(n int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.done += n
	p.drawLocked(p.done >= p.total)
	p.mu.Unlock()
}

// Clear erases the bar (before other output).
func (p *Progress) Clear() {
	if p == nil {
		return
	}
	p.mu.Lock()
	fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
	p.width = 0
	p.mu.Unlock()
}

func (p *Progress) drawLocked(force bool) {
	now := time.Now()
	if !force && now.Sub(p.last) < 100*time.Millisecond {
		return
	}
	p.last = now
	const bar = 30
	filled := 0
	if p.total > 0 {
		filled = min(bar, p.done*bar/p.total)
	}
	line := fmt.Sprintf("[%s%s] %d/%d %s", strings.Repeat("#", filled), strings.Repeat(" ", bar-filled), p.done, p.total, p.label)
	pad := max(0, p.width-len(line))
	fmt.Fprintf(p.w, "\r%s%s", line, strings.Repeat(" ", pad))
	p.width = len(line)
}
