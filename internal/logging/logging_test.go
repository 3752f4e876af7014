package logging

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestNew(t *testing.T) {
	tests := []struct {
		level, format string
		json          bool
	}{
		{"info", "json", true},
		{"debug", "auto", true}, // a buffer is not a terminal
		{"warn", "text", false},
	}
	for _, tt := range tests {
		var buf bytes.Buffer
		log, err := New(&buf, tt.level, tt.format)
		if err != nil {
			t.Fatal(err)
		}
		log.Warn("disk full", "mount", "/nvme")
		line := buf.String()
		var m map[string]any
		isJSON := json.Unmarshal([]byte(line), &m) == nil
		if isJSON != tt.json || !strings.Contains(line, "disk full") || !strings.Contains(line, "/nvme") {
			t.Errorf("%s/%s wrote %q", tt.level, tt.format, line)
		}
	}
	var buf bytes.Buffer
	log, _ := New(&buf, "error", "json")
	log.Info("hidden")
	if buf.Len() != 0 {
		t.Errorf("info logged at level error: %q", buf.String())
	}
	for _, bad := range [][2]string{{"loud", "json"}, {"info", "xml"}} {
		if _, err := New(&buf, bad[0], bad[1]); err == nil {
			t.Errorf("New(%q, %q) accepted", bad[0], bad[1])
		}
	}
}

// TestJSONDurationsAreStrings: a duration is a string in JSON whether it was
// logged as a time.Duration, in a group, or as a string already.
func TestJSONDurationsAreStrings(t *testing.T) {
	var buf bytes.Buffer
	log, err := New(&buf, "info", "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("engine: open", "rebuild", 1500*time.Millisecond, slog.Group("policy", "took", 2*time.Microsecond), "in", (3 * time.Second).String())
	var m struct {
		Rebuild any `json:"rebuild"`
		Policy  struct {
			Took any `json:"took"`
		} `json:"policy"`
		In any `json:"in"`
	}
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatal(err)
	}
	if m.Rebuild != "1.5s" || m.Policy.Took != "2µs" || m.In != "3s" {
		t.Fatalf("durations logged as %#v, %#v, %#v in %s", m.Rebuild, m.Policy.Took, m.In, buf.String())
	}
}

// TestNewLeveledFollowsItsLevel: changing the LevelVar changes what is
// logged (a reload of log.level).
func TestNewLeveledFollowsItsLevel(t *testing.T) {
	var buf bytes.Buffer
	var lv slog.LevelVar
	lv.Set(slog.LevelWarn)
	log, err := NewLeveled(&buf, &lv, "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("before")
	lv.Set(slog.LevelInfo)
	log.Info("after")
	if strings.Contains(buf.String(), "before") || !strings.Contains(buf.String(), "after") {
		t.Fatalf("logged %q", buf.String())
	}
}

// TestTextLinesBeginWithTheDate: a daemon's log spans days, so the text
// format's time has the date as well as the time of day.
func TestTextLinesBeginWithTheDate(t *testing.T) {
	var buf bytes.Buffer
	log, err := New(&buf, "info", "text")
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	log.Info("ready")
	stamp, _, ok := strings.Cut(buf.String(), " INF ")
	if !ok {
		t.Fatalf("no level after the time in %q", buf.String())
	}
	at, err := time.ParseInLocation(textTime, stamp, time.Local)
	if err != nil {
		t.Fatalf("time %q: %v", stamp, err)
	}
	if d := at.Sub(before.Truncate(time.Millisecond)); d < 0 || d > time.Minute {
		t.Errorf("time %q is %v from now", stamp, d)
	}
}
