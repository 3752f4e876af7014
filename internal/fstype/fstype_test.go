package fstype

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestKnownAndUnknownMagics(t *testing.T) {
	for _, c := range []struct {
		magic         int64
		name          string
		known, memory bool
		network       bool
	}{
		{Tmpfs, "tmpfs", true, true, false},
		{Hugetlbfs, "hugetlbfs", true, true, false},
		{Ext4, "ext4", true, false, false},
		{0x6969, "nfs", true, false, true},
		{0x1234, "0x1234", false, false, false},
	} {
		k, ok := Of(c.magic)
		if ok != c.known || k.Memory != c.memory || k.Network != c.network || Name(c.magic) != c.name {
			t.Errorf("magic %#x: Of = %+v, %v; Name = %q; want %q known %v memory %v network %v",
				c.magic, k, ok, Name(c.magic), c.name, c.known, c.memory, c.network)
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
