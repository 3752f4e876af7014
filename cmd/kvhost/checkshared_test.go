package main

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/fstype"
)

func TestProbeFlockExcludesASecondLockOnALocalDirectory(t *testing.T) {
	dir := t.TempDir()
	if err := probeFlock(dir); err != nil {
		t.Fatalf("probeFlock on a local directory: %v", err)
	}
	if tmp := tempFilesIn(t, dir); len(tmp) > 0 {
		t.Fatalf("the probe left %v", tmp)
	}
}

// tempFilesIn names the entries of dir.
func tempFilesIn(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestSharedFindingNamesFUSEAndWhatGuardsOtherNodesStores(t *testing.T) {
	if level, _, _ := sharedFinding(fstype.Ext4, nil, time.Minute); level != "" {
		t.Errorf("ext4: level %q, want none", level)
	}
	level, what, fix := sharedFinding(fstype.FUSE, nil, 10*time.Minute)
	if level != levelInfo || !strings.Contains(what, "0x65735546") || !strings.Contains(what, "flock works") || !strings.Contains(what, "10m0s") || fix == "" {
		t.Errorf("FUSE with flock: %q %q %q", level, what, fix)
	}
	level, what, _ = sharedFinding(fstype.FUSE, errors.New("operation not supported"), time.Minute)
	if level != levelWarn || !strings.Contains(what, "only by temp_grace") {
		t.Errorf("FUSE without flock: %q %q", level, what)
	}
}
