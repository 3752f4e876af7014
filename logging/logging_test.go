package logging

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
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
