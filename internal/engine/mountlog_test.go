//go:build invariants

package engine

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/fstype"
)

// lockedBuffer is a bytes.Buffer for a logger's handler.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// records returns the JSON records logged with message msg.
func (l *lockedBuffer) records(t *testing.T, msg string) []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for line := range bytes.Lines(l.b.Bytes()) {
		var r map[string]any
		if err := json.Unmarshal(line, &r); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if r["msg"] == msg {
			out = append(out, r)
		}
	}
	return out
}

// TestMountLogLineSaysWhatThePolicyIsTold: the "engine: mount" line of
// each mount names the device class the policy is told and where it came
// from (configured or detected), the file system found and whether the
// mount uses direct I/O.
func TestMountLogLineSaysWhatThePolicyIsTold(t *testing.T) {
	var buf lockedBuffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	dirs := []string{t.TempDir(), t.TempDir()}
	e := openEngine(t, Config{Logger: log, Policy: newTestPolicy(1, 0), Mounts: []Mount{
		{Path: dirs[0], DeviceClass: "hdd"},
		{Path: dirs[1]},
	}})
	recs := buf.records(t, "engine: mount")
	if len(recs) != 2 {
		t.Fatalf("%d \"engine: mount\" lines, want 2: %v", len(recs), recs)
	}
	st := e.Stats()
	for i, tc := range []struct{ class, from string }{
		{"hdd", "configured"},
		{"", "detected"}, // whatever the temporary directory is on
	} {
		r := recs[i]
		var sfs unix.Statfs_t
		if err := unix.Statfs(dirs[i], &sfs); err != nil {
			t.Fatal(err)
		}
		wantFS := "unknown"
		if k, ok := fstype.Of(int64(sfs.Type)); ok {
			wantFS = k.Name
		}
		class, _ := r["device_class"].(string)
		if tc.class == "" && slices.Contains([]string{"unknown", "memory", "nvme", "ssd", "hdd", "network"}, class) {
			tc.class = class
		}
		if r["mount"] != dirs[i] || class != tc.class || r["device_class_from"] != tc.from || r["fs"] != wantFS || r["direct_io"] != st.Mounts[i].Direct {
			t.Errorf("mount %d: logged %v; want device_class %q from %q, fs %q, direct_io %v", i, r, tc.class, tc.from, wantFS, st.Mounts[i].Direct)
		}
	}
}
