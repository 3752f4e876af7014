package fstype

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestKnownAndUnknownMagics(t *testing.T) {
	for _, c := range []struct {
		magic         int64
		name          string
		known, memory bool
		network       bool
		mapOnly       bool
		kernel        bool
	}{
		{Tmpfs, "tmpfs", true, true, false, false, false},
		{Ramfs, "ramfs", true, true, false, false, false},
		{Hugetlbfs, "hugetlbfs", true, true, false, true, false},
		{Ext4, "ext4", true, false, false, false, false},
		{0x6969, "nfs", true, false, true, false, false},
		// Docker Desktop's bind mounts of the host's directories, not
		// virtiofs: that is a FUSE file system and reports FUSE's magic.
		{0x6a656a63, "fakeowner", true, false, false, false, false},
		{0x65735546, "fuse", true, false, true, false, false},
		// Kernel interfaces: a directory there keeps no files.
		{0x9fa0, "proc", true, false, false, false, true},
		{0x62656572, "sysfs", true, false, false, false, true},
		{0x63677270, "cgroup2", true, false, false, false, true},
		{0x1234, "0x1234", false, false, false, false, false},
	} {
		k, ok := Of(c.magic)
		if ok != c.known || k.Memory != c.memory || k.Network != c.network || k.MapOnly != c.mapOnly || k.Kernel != c.kernel || Name(c.magic) != c.name {
			t.Errorf("magic %#x: Of = %+v, %v; Name = %q; want %q known %v memory %v network %v map only %v kernel %v",
				c.magic, k, ok, Name(c.magic), c.name, c.known, c.memory, c.network, c.mapOnly, c.kernel)
		}
	}
}

// TestCuFileDirect: the file systems cuFile reaches with nvidia-fs are the
// ones gds listed by name before the table owned them, and only those.
func TestCuFileDirect(t *testing.T) {
	want := map[string]bool{"ext4": true, "xfs": true, "nfs": true, "lustre": true, "gpfs": true, "beegfs": true}
	for magic, k := range kinds {
		if k.CuFileDirect != want[k.Name] {
			t.Errorf("%s (%#x): CuFileDirect %v, want %v", k.Name, magic, k.CuFileDirect, want[k.Name])
		}
		delete(want, k.Name)
	}
	if len(want) != 0 {
		t.Errorf("not in the table: %v", want)
	}
}

func TestOfPathAgreesWithStatfs(t *testing.T) {
	dir := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	magic, name, err := OfPath(dir)
	if err != nil || magic != int64(st.Type) || name != Name(int64(st.Type)) {
		t.Fatalf("OfPath(%s) = %#x, %q, %v; statfs says %#x", dir, magic, name, err, st.Type)
	}
	if _, _, err := OfPath(dir + "/missing"); err == nil {
		t.Fatalf("OfPath of a missing path: no error")
	}
}

func TestParseMountInfoReadsTypeSourceDeviceAndEscapedPoints(t *testing.T) {
	const info = `22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
42 27 0:39 / /tmp/kvc/node1 rw,nosuid,nodev,relatime - fuse.ceph-fuse ceph-fuse rw,user_id=0,group_id=0,allow_other
50 22 0:50 / /mnt/gluster\040vol rw,relatime shared:7 master:3 - fuse.glusterfs server:/vol rw,user_id=0
51 22 0:51 / /mnt/plain rw - fuse sshfs#me@host: rw
`
	ms, err := ParseMountInfo(strings.NewReader(info))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct{ point, typ, source, subtype, dev string }{
		{"/", "ext4", "/dev/vda", "", "252:1"},
		{"/tmp/kvc/node1", "fuse.ceph-fuse", "ceph-fuse", "ceph-fuse", "0:39"},
		{"/mnt/gluster vol", "fuse.glusterfs", "server:/vol", "glusterfs", "0:50"},
		{"/mnt/plain", "fuse", "sshfs#me@host:", "sshfs#me@host:", "0:51"},
	}
	if len(ms) != len(want) {
		t.Fatalf("%d mounts, want %d: %+v", len(ms), len(want), ms)
	}
	for i, w := range want {
		if m := ms[i]; m.Point != w.point || m.Type != w.typ || m.Source != w.source || m.Subtype() != w.subtype || m.Dev != w.dev {
			t.Errorf("line %d: %+v subtype %q; want %+v", i+1, m, m.Subtype(), w)
		}
	}
}

func TestParseMountInfoRefusesALineWithoutSeparator(t *testing.T) {
	_, err := ParseMountInfo(strings.NewReader("42 27 0:39 / /mnt rw,relatime fuse.ceph-fuse ceph-fuse rw\n"))
	if !errors.Is(err, errMountInfo) || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("err = %v, want errMountInfo naming line 1", err)
	}
}

func TestContainingPicksTheLongestLastMountPoint(t *testing.T) {
	ms := []Mount{
		{Point: "/", Type: "ext4"},
		{Point: "/mnt/a", Type: "tmpfs"},
		{Point: "/mnt/ab", Type: "xfs"},
		{Point: "/mnt/a", Type: "fuse.ceph-fuse"}, // mounted over the tmpfs
	}
	for _, c := range []struct {
		path, typ string
	}{
		{"/", "ext4"},
		{"/mnt", "ext4"},
		{"/mnt/a", "fuse.ceph-fuse"},
		{"/mnt/a/x/y", "fuse.ceph-fuse"},
		{"/mnt/ab/x", "xfs"},
		{"/mnt/abc", "ext4"},
	} {
		m, ok := Containing(ms, c.path)
		if !ok || m.Type != c.typ {
			t.Errorf("Containing(%s) = %+v, %v; want type %s", c.path, m, ok, c.typ)
		}
	}
	if _, ok := Containing(ms[1:], "/etc"); ok {
		t.Error("Containing found a mount for a path no mount point holds")
	}
}

func TestMountOfNamesAMountPointHoldingThePath(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	m, err := MountOf(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Type == "" || (m.Point != "/" && dir != m.Point && !strings.HasPrefix(dir, m.Point+"/")) {
		t.Fatalf("MountOf(%s) = %+v: not a mount point holding it", dir, m)
	}
}

func TestFUSEKindsKnowCephFUSEAndGlusterFS(t *testing.T) {
	for _, c := range []struct {
		subtype string
		known   bool
		flock   bool
	}{
		{"ceph-fuse", true, true},
		{"glusterfs", true, true},
		{"sshfs", false, false},
	} {
		k, ok := FUSEOf(c.subtype)
		if ok != c.known || k.SharedFlock != c.flock || (ok && (k.Name == "" || k.Coherence == "")) {
			t.Errorf("FUSEOf(%q) = %+v, %v; want known %v, shared flock %v", c.subtype, k, ok, c.known, c.flock)
		}
	}
}
