package fsys

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/region"
)

// mapped writes size patterned bytes to a new file and maps its first n.
func mapped(t *testing.T, size, n int64) (File, *Mapping, []byte) {
	t.Helper()
	f, err := OS{}.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*7 + i>>9)
	}
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	m, err := f.(Mapper).MapRead(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return f, m, want
}

func TestMappingReadsLikeReadAt(t *testing.T) {
	const size = 3*4096 + 100
	_, m, want := mapped(t, size, 1<<20) // asks for more than the file has
	if m.Len() != size {
		t.Fatalf("Len() = %d, want the file's %d bytes", m.Len(), size)
	}
	cases := []struct {
		name    string
		off     int64
		len     int
		wantN   int
		wantErr error
	}{
		{"start", 0, 4096, 4096, nil},
		{"across pages", 4000, 5000, 5000, nil},
		{"up to the end", size - 300, 300, 300, nil},
		{"past the end", size - 50, 100, 50, io.EOF},
		{"at the end", size, 10, 0, io.EOF},
		{"beyond the end", size + 4096, 10, 0, io.EOF},
		{"negative offset", -1, 10, 0, ErrMapping},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := make([]byte, c.len)
			n, err := m.ReadAt(p, c.off)
			if n != c.wantN || !errors.Is(err, c.wantErr) || (c.wantErr == nil && err != nil) {
				t.Fatalf("ReadAt(%d bytes at %d) = %d, %v; want %d, %v", c.len, c.off, n, err, c.wantN, c.wantErr)
			}
			if n > 0 && !bytes.Equal(p[:n], want[c.off:c.off+int64(n)]) {
				t.Fatalf("ReadAt(%d bytes at %d): bytes differ from the file's", c.len, c.off)
			}
		})
	}
}

func TestMappingOfPartOrNothing(t *testing.T) {
	_, m, want := mapped(t, 3*4096, 5000)
	if m.Len() != 8192 {
		t.Fatalf("Len() = %d, want the 5000 bytes asked for rounded up to whole pages", m.Len())
	}
	p := make([]byte, 100)
	if n, err := m.ReadAt(p, 8142); n != 50 || err != io.EOF || !bytes.Equal(p[:50], want[8142:8192]) {
		t.Fatalf("ReadAt across the mapping's end = %d, %v", n, err)
	}
	_, empty, _ := mapped(t, 0, 4096)
	if n, err := empty.ReadAt(p, 0); n != 0 || err != io.EOF || empty.Len() != 0 {
		t.Fatalf("an empty file's mapping: ReadAt = %d, %v; Len %d", n, err, empty.Len())
	}
	if err := empty.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if n, err := m.ReadAt(p, 0); n != 0 || err != io.EOF {
		t.Fatalf("ReadAt after Close = %d, %v; want 0, EOF", n, err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestTruncatedUnderTheMappingFailsTheRead: another process truncating a
// mapped file turns the next read of the vanished pages into a fault; the
// read fails with ErrMapping and region.ErrFault, and the process lives.
func TestTruncatedUnderTheMappingFailsTheRead(t *testing.T) {
	f, m, want := mapped(t, 64<<10, 64<<10)
	if err := os.Truncate(f.(*osFile).name, 4096); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 8192)
	if n, err := m.ReadAt(p[:4096], 0); n != 4096 || err != nil || !bytes.Equal(p[:4096], want[:4096]) {
		t.Fatalf("ReadAt of the page that is left = %d, %v", n, err)
	}
	n, err := m.ReadAt(p, 16<<10)
	if !errors.Is(err, ErrMapping) || !errors.Is(err, region.ErrFault) {
		t.Fatalf("ReadAt of truncated pages = %d, %v; want ErrMapping and region.ErrFault", n, err)
	}
}

func TestFaultyFilesAreNotMappers(t *testing.T) {
	fs := &Faulty{FS: OS{}, Inj: &Counter{}}
	f, err := fs.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, ok := f.(Mapper); ok {
		t.Fatal("a Faulty file is a Mapper: reads through it would escape fault injection")
	}
}
