// Package testtrace records a Go execution trace around a test's code and
// reads its tasks, regions and logs back, as `go tool trace -d=parsed`
// prints them: for tests that check what a trace shows an operator.
package testtrace

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/trace"
	"slices"
	"testing"
)

// Event is a task's, region's or log's event of a trace.
type Event struct {
	// Kind is TaskBegin, TaskEnd, RegionBegin, RegionEnd or Log.
	Kind string
	// Task is the task's id (a region's or log's task; 0: none).
	Task string
	// Name is the task's or region's type, or the log's message.
	Name string
}

// reEvent matches the events Event holds in `go tool trace -d=parsed`'s
// lines.
var reEvent = regexp.MustCompile(`\b(TaskBegin|TaskEnd|RegionBegin|RegionEnd|Log) .*?(?:ID|Task)=(\d+).*?(?:Type|Message)="([^"]*)"`)

// Record runs fn while an execution trace is taken, and returns the
// trace's events in order, read by the go command on the PATH (go test's
// own). It skips the test where a trace is being taken
// already (go test -trace), which a second cannot join.
func Record(t testing.TB, fn func()) []Event {
	t.Helper()
	if trace.IsEnabled() {
		t.Skip("an execution trace is being taken already (go test -trace): a second cannot start")
	}
	path := filepath.Join(t.TempDir(), "trace.out")
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := trace.Start(out); err != nil {
		t.Fatal(err)
	}
	fn()
	trace.Stop()
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	parsed, err := exec.Command("go", "tool", "trace", "-d=parsed", path).CombinedOutput()
	if err != nil {
		t.Fatalf("go tool trace -d=parsed: %v\n%.2000s", err, parsed)
	}
	var evs []Event
	for _, m := range reEvent.FindAllStringSubmatch(string(parsed), -1) {
		evs = append(evs, Event{Kind: m[1], Task: m[2], Name: m[3]})
	}
	return evs
}

// Regions returns the types of the regions begun in task (every task's
// where task is ""), in the order first begun, and whether every region
// begun was ended.
func Regions(evs []Event, task string) (names []string, ended bool) {
	open := map[string]int{}
	for _, e := range evs {
		if task != "" && e.Task != task {
			continue
		}
		switch e.Kind {
		case "RegionBegin":
			if !slices.Contains(names, e.Name) {
				names = append(names, e.Name)
			}
			open[e.Name]++
		case "RegionEnd":
			open[e.Name]--
		}
	}
	for _, n := range open {
		if n != 0 {
			return names, false
		}
	}
	return names, true
}
