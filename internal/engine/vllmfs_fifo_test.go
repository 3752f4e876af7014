//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestAVllmFSNamedPipeAtARowNameBlocksNoRequest: a named pipe sits where
// a key's row would be (planted in vLLM's shared directory, or left by a
// tool), or replaced a row indexed before. A lookup of the key is a miss
// and a delete of it returns: neither waits for a writer of the pipe,
// which would hold the request, and every later one of the key, forever.
func TestAVllmFSNamedPipeAtARowNameBlocksNoRequest(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(9, 2)
	tier.store(t, keys[1], randomRow(rand.New(rand.NewPCG(1, 1)), row))
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	ns, err := e.Declare(ctx, rowGeometry(tierModel, row))
	if err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Entries != 1 {
		t.Fatalf("%d entries after open, want the row", st.Entries)
	}
	for _, k := range keys {
		p := tier.path(k)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		os.Remove(p)
		if err := syscall.Mkfifo(p, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	testwait.ReturnsDespitePipe(t, "a lookup", tier.path(keys[0]), func() {
		if n, err := e.Lookup(ctx, ns, keys[:1]); n != 0 || err != nil {
			t.Errorf("lookup: %d, %v; want a miss", n, err)
		}
	})
	testwait.ReturnsDespitePipe(t, "a delete", tier.path(keys[1]), func() {
		if _, err := e.Delete(ctx, ns, keys[1:]); err != nil {
			t.Logf("delete: %v", err)
		}
	})
}

// TestAVllmFSConfigThatIsANamedPipeBlocksNoStart: someone who can write
// vLLM's shared directory put a named pipe at a base directory's
// config.json. Open returns rather than wait for a writer of the pipe:
// where the pipe is the configured base directory's config.json, it
// refuses the mount with ErrInvalid naming the path and leaves the pipe
// (it is no config.json cut by a crash, to be written anew); where it is
// another base directory's, that one is skipped and the tier's base
// directory adopted, as by `kvhost check` (AdoptedBase).
func TestAVllmFSConfigThatIsANamedPipeBlocksNoStart(t *testing.T) {
	for _, tc := range []struct {
		name       string
		configured bool // the pipe is the configured base directory's config.json
	}{
		{"the configured base directory's", true},
		{"another base directory's, beside the one adopted", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tier := newFSTier(root, 8192)
			mount := Mount{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel}}
			pipe := filepath.Join(tier.base(), "config.json")
			if tc.configured {
				mount.VLLMFS.Fields = tier.fields()
			} else {
				tier.init(t)
				other := newFSTier(root, 8192)
				other.tp = 2
				pipe = filepath.Join(other.base(), "config.json")
			}
			if err := os.MkdirAll(filepath.Dir(pipe), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Mkfifo(pipe, 0o644); err != nil {
				t.Fatal(err)
			}
			testwait.ReturnsDespitePipe(t, "Open", pipe, func() {
				e, err := testOpen(context.Background(), Config{Mounts: []Mount{mount}, Policy: newTestPolicy(4, abi.OrderBlockMajor), Logger: testLogger(t), IOWorkers: 2})
				if err == nil {
					e.Close(context.Background())
				}
				switch {
				case tc.configured && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), pipe)):
					t.Errorf("Open: %v, want ErrInvalid naming %s", err, pipe)
				case !tc.configured && err != nil:
					t.Errorf("Open: %v, want the tier's base directory adopted past the pipe", err)
				}
			})
			if fi, err := os.Lstat(pipe); err != nil || fi.Mode().Type() != os.ModeNamedPipe {
				t.Errorf("the named pipe at %s was replaced (%v)", pipe, err)
			}
			if tc.configured {
				return
			}
			testwait.ReturnsDespitePipe(t, "AdoptedBase", pipe, func() {
				if got, err := AdoptedBase(root); err != nil || got != filepath.Base(tier.base()) {
					t.Errorf("AdoptedBase: %q, %v; want %q", got, err, filepath.Base(tier.base()))
				}
			})
		})
	}
}
