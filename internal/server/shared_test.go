package server_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
)

// shmFile creates a /dev/shm file of size bytes as vLLM creates its shared
// CPU region (/dev/shm/vllm_offload_*.mmap), maps it here, and returns the
// open file (to send and to truncate) and the mapping.
func shmFile(t *testing.T, size int64) (*os.File, *region.Host) {
	t.Helper()
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Skip("no /dev/shm on this machine")
	}
	f, err := os.CreateTemp("/dev/shm", "kvhost-server-test-*.mmap")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(f.Name()); f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	h, err := region.OpenShared(fd, size)
	if err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return f, h
}

func cacheBytes() int64 { return int64(geo.Layers) * 2 * numBlocks * geo.BlockBytes() }

// TestSharedFileRegistration: unsealed shared-memory files are accepted
// only by a daemon configured for them, and only from memory file
// systems; a sealed memfd keeps working either way.
func TestSharedFileRegistration(t *testing.T) {
	shm, _ := shmFile(t, 1<<20)
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	unix.Ftruncate(unsealed, 1<<20)
	disk, err := os.CreateTemp(t.TempDir(), "disk")
	if err != nil {
		t.Fatal(err)
	}
	defer disk.Close()
	disk.Truncate(1 << 20)
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(disk.Fd()), &fs); err != nil || fs.Type == fstype.Tmpfs {
		t.Skip("the test's temporary directory is on tmpfs: no disk file to refuse")
	}
	tests := []struct {
		name   string
		shared bool // Config.SharedFiles
		fd     int
		size   int64
		want   protocol.Code
	}{
		{"dev shm file", true, int(shm.Fd()), 1 << 20, protocol.CodeOK},
		{"unsealed memfd", true, unsealed, 1 << 20, protocol.CodeOK},
		{"larger than the file", true, int(shm.Fd()), 2 << 20, protocol.CodeBadFd},
		{"file on disk", true, int(disk.Fd()), 1 << 20, protocol.CodeBadFd},
		{"daemon not configured for shared files", false, int(shm.Fd()), 1 << 20, protocol.CodeUnsupported},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, server.Config{SharedFiles: tc.shared})
			c := f.dial(t)
			_, err := c.RegisterShared(context.Background(), tc.fd, tc.size)
			wantCode(t, err, tc.want)
			// The connection stays usable either way.
			if _, err := c.Stats(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestSharedFileRoundTrip stores from and loads into a /dev/shm file the
// client never sealed, byte for byte.
func TestSharedFileRoundTrip(t *testing.T) {
	f := newFixture(t, server.Config{SharedFiles: true})
	c := f.dial(t)
	file, mem := shmFile(t, cacheBytes())
	rid, err := c.RegisterShared(context.Background(), int(file.Fd()), cacheBytes())
	if err != nil {
		t.Fatal(err)
	}
	k := newCacheIn(t, c, mem, rid)
	rng := rand.New(rand.NewPCG(3, 4))
	want := k.store(t, "shared", []uint32{2, 7}, rng)
	if got := k.load(t, "shared", []uint32{11, 4}); !bytes.Equal(got, want) {
		t.Fatal("loaded bytes differ")
	}
}

// TestTruncatedSharedFileFailsTransfer: a client truncates its shared file
// under the daemon's mapping; its next store and load fail with a clear
// error (nothing touches the missing pages), it cannot unregister what a
// cache uses, and the daemon serves the next client.
func TestTruncatedSharedFileFailsTransfer(t *testing.T) {
	f := newFixture(t, server.Config{SharedFiles: true})
	c := f.dial(t)
	file, mem := shmFile(t, cacheBytes())
	rid, err := c.RegisterShared(context.Background(), int(file.Fd()), cacheBytes())
	if err != nil {
		t.Fatal(err)
	}
	k := newCacheIn(t, c, mem, rid)
	k.store(t, "before", []uint32{0, 1}, rand.New(rand.NewPCG(5, 6)))
	if err := file.Truncate(0); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		do   func() (*client.Job, error)
	}{
		{"store", func() (*client.Job, error) {
			return c.Store(ctx, k.id, [][]byte{[]byte("after")}, [][]uint32{{2, 3}})
		}},
		{"load", func() (*client.Job, error) {
			return c.Load(ctx, k.id, [][]byte{[]byte("before")}, [][]uint32{{2, 3}})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.do()
			wantCode(t, err, protocol.CodeBadFd)
			if !strings.Contains(err.Error(), "truncated") {
				t.Fatalf("error %q does not say the file was truncated", err)
			}
		})
	}
	// What was stored before is still there, for a well-behaved client.
	next := f.dial(t)
	if n, err := next.Lookup(ctx, k.ns.ID, [][]byte{[]byte("before")}); err == nil {
		t.Fatalf("lookup in another connection's namespace id answered %d", n)
	}
	k2 := newCache(t, next)
	if n, err := next.Lookup(ctx, k2.ns.ID, [][]byte{[]byte("before")}); err != nil || n != 1 {
		t.Fatalf("the next client finds %d keys (%v), want the key stored before the truncation", n, err)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	want := k2.store(t, "next", []uint32{1, 2}, rng)
	if got := k2.load(t, "next", []uint32{3, 4}); !bytes.Equal(got, want) {
		t.Fatal("the next client's round trip differs")
	}
}
