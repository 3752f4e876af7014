//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/fstype"
)

// TestAFileSystemRefusingDirectIOGetsBufferedIOAndNoProbeLeft: where the
// file system refuses O_DIRECT, at the open or at the first write, the
// mount is buffered, the probe leaves no file behind (the open that fails
// has created it), and stores and loads work.
func TestAFileSystemRefusingDirectIOGetsBufferedIOAndNoProbeLeft(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	for _, tt := range []struct {
		name    string
		atWrite bool
	}{
		{"at the open", false},
		{"at the first write", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: fsystest.RefusesDirect{FS: fsys.OS{}, AtWrite: tt.atWrite}})
			if l := leftovers(t, dir); len(l) != 0 {
				t.Errorf("files left by the O_DIRECT probe: %v", l)
			}
			if ms := e.Stats().Mounts[0]; ms.Direct || ms.IO != "buffered" {
				t.Fatalf("mount: direct %v, io %q: want buffered", ms.Direct, ms.IO)
			}
			ns, _ := e.Declare(ctx, g)
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			keys, blocks := testKeys("buffered", 1), [][]int{{0, 1, 2, 3}}
			c.fill(rand.New(rand.NewPCG(3, 3)), blocks[0])
			storeAndCheck(t, e, c, keys, blocks)
			loadAndCompare(t, e, c, keys, [][]int{{4, 5, 6, 7}}, [][]byte{c.data(blocks[0])})
		})
	}
}

// hugetlbFS says that every path is on a hugetlbfs with room: a file
// system whose files write(2) refuses (EINVAL), only mappings write them.
type hugetlbFS struct{ fsys.FS }

func (f hugetlbFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.FS.Statfs(path)
	st.Type, st.Total, st.Free, st.Avail = fstype.Hugetlbfs, 1<<30, 1<<30, 1<<30
	return st, err
}

// TestOpenRefusesAHugetlbfsMount: every store would fail there (write(2)
// refuses hugetlbfs files), so Open refuses the mount, naming it, its file
// system and what to use instead, and touches nothing in it.
func TestOpenRefusesAHugetlbfsMount(t *testing.T) {
	for _, capacity := range []int64{0, 64 << 20} {
		dir := t.TempDir()
		e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: dir, Capacity: capacity}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: hugetlbFS{fsys.OS{}}, Logger: testLogger(t)})
		if err == nil {
			e.Close(context.Background())
		}
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "hugetlbfs") || !strings.Contains(err.Error(), "tmpfs") {
			t.Fatalf("capacity %d: Open: %v: want ErrInvalid naming the mount, hugetlbfs and tmpfs", capacity, err)
		}
		if l := leftovers(t, dir); len(l) != 0 {
			t.Fatalf("capacity %d: files left in the refused mount: %v", capacity, l)
		}
	}
}

// kernelFS says that every path is on proc, a kernel interface that
// reports no size and keeps no files of kvhost's.
type kernelFS struct{ fsys.FS }

func (f kernelFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.FS.Statfs(path)
	st.Type, st.Total, st.Free, st.Avail = 0x9fa0, 0, 0, 0
	return st, err
}

// TestOpenRefusesAMountOnAKernelInterface: a mount on proc or sysfs
// (kvhost --dir /proc, given a capacity) was opened, its index rebuilt
// by walking the kernel's tree (a start on /proc stopped at "open
// /proc/1/fdinfo: permission denied"; one on /sys/kernel/mm indexed
// nothing and served with every store failing, its fix saying to chown
// the directory). Open refuses such a mount, naming it and its file
// system, and touches nothing in it.
func TestOpenRefusesAMountOnAKernelInterface(t *testing.T) {
	dir := t.TempDir()
	e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: dir, Capacity: 64 << 20}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: kernelFS{fsys.OS{}}, Logger: testLogger(t)})
	if err == nil {
		e.Close(context.Background())
	}
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "proc") || !strings.Contains(err.Error(), "kernel interface") {
		t.Fatalf("Open: %v: want ErrInvalid naming the mount, proc and what it is", err)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("files left in the refused mount: %v", l)
	}
}
