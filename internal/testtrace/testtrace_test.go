package testtrace

import (
	"context"
	"runtime/trace"
	"slices"
	"testing"
)

// TestRecordReadsTasksRegionsAndLogsBack: a task, its log and its nested
// regions, and a region outside any task, come back in order with their
// task ids; Regions lists a task's regions and says whether each ended.
func TestRecordReadsTasksRegionsAndLogsBack(t *testing.T) {
	evs := Record(t, func() {
		ctx, task := trace.NewTask(context.Background(), "job")
		trace.Log(ctx, "what", "layers 1-2")
		trace.WithRegion(ctx, "outer", func() { trace.WithRegion(ctx, "inner", func() {}) })
		trace.StartRegion(ctx, "left open")
		task.End()
		trace.WithRegion(context.Background(), "no task", func() {})
	})
	var id string
	for _, e := range evs {
		if e.Kind == "TaskBegin" && e.Name == "job" {
			id = e.Task
		}
	}
	if id == "" || id == "0" {
		t.Fatalf("no task \"job\" in %v", evs)
	}
	if !slices.Contains(evs, Event{Kind: "Log", Task: id, Name: "layers 1-2"}) {
		t.Errorf("the task's log is not in %v", evs)
	}
	names, ended := Regions(evs, id)
	if want := []string{"outer", "inner", "left open"}; !slices.Equal(names, want) || ended {
		t.Errorf("Regions(task) = %q, %v; want %q, false (one left open)", names, ended, want)
	}
	if names, _ := Regions(evs, ""); !slices.Contains(names, "no task") {
		t.Errorf("Regions(every task) = %q, want it to hold the region outside any task", names)
	}
}
