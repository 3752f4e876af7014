package gpu

import "testing"

// closed reports whether c is closed.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// TestActivitySignalsTheTurnsBetweenIdleAndBusy: the idle channel is
// closed exactly while no job runs, the busy one exactly while some do,
// and a channel taken before a turn is closed by it.
func TestActivitySignalsTheTurnsBetweenIdleAndBusy(t *testing.T) {
	a := newActivity()
	idle0, busy0 := a.signals()
	steps := []struct {
		name       string
		do         func()
		jobs       int32
		idle, busy bool
	}{
		{"new", func() {}, 0, true, false},
		{"first job begins", a.begin, 1, false, true},
		{"second job begins", a.begin, 2, false, true},
		{"one ends", a.end, 1, false, true},
		{"the last ends", a.end, 0, true, false},
		{"another begins", a.begin, 1, false, true},
	}
	var idle1 <-chan struct{}
	for _, s := range steps {
		s.do()
		idle, busy := a.signals()
		if a.jobs() != s.jobs || closed(idle) != s.idle || closed(busy) != s.busy {
			t.Fatalf("%s: %d jobs, idle closed %v, busy closed %v; want %d, %v, %v", s.name, a.jobs(), closed(idle), closed(busy), s.jobs, s.idle, s.busy)
		}
		if s.name == "first job begins" {
			idle1 = idle
		}
	}
	if !closed(idle0) || !closed(busy0) || !closed(idle1) {
		t.Fatalf("channels taken earlier: idle at start closed %v, busy at start closed %v, idle during the first jobs closed %v; want all closed by the turns since", closed(idle0), closed(busy0), closed(idle1))
	}
}
