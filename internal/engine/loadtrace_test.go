//go:build invariants

package engine

import (
	"context"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/testtrace"
)

// TestALoadIsATaskWithItsPhasesAsRegions: an execution trace taken during
// a layer-range load shows it as a "load" task that logs its range, with
// a region for each phase of the job (pin, turn, file slots, files) and
// of its file (open, read, verify), each ended.
func TestALoadIsATaskWithItsPhasesAsRegions(t *testing.T) {
	f := newLayerFixture(t, IOBuffered, abi.OrderLayerMajor, 1, layoutPlaneFirst)
	var res Result
	evs := testtrace.Record(t, func() {
		res = wait(t)(f.e.Load(context.Background(), LoadRequest{Cache: f.c.id, Keys: f.keys[:1], Blocks: [][]int{{20, 21, 22, 23}},
			Layers: LayerRange{First: 1, Count: 2}}))
	})
	wantOutcomes(t, "load", res, OutcomeLoaded)
	var task string
	for _, e := range evs {
		if e.Kind == "TaskBegin" && e.Name == "load" {
			if task != "" {
				t.Fatalf("two load tasks (%s, %s) for one load", task, e.Task)
			}
			task = e.Task
		}
	}
	if task == "" {
		t.Fatalf("no load task in the trace: %v", evs)
	}
	if !slices.Contains(evs, testtrace.Event{Kind: "Log", Task: task, Name: "layers [1, 3)"}) {
		t.Errorf("the load's task does not log its range: %v", evs)
	}
	regions, ended := testtrace.Regions(evs, task)
	for _, r := range []string{"load: pin", "load: turn", "load: file slots", "load: files", "load: open", "load: read", "load: verify"} {
		if !slices.Contains(regions, r) {
			t.Errorf("no region %q in the load's task; it has %q", r, regions)
		}
	}
	if !ended {
		t.Errorf("a region of the load's task was not ended: %v", evs)
	}
}
