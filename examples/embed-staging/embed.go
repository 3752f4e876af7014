// Command embed-staging embeds kvhost's CPU staging pipeline in a
// program of another module: it writes three extents of host memory to
// a file through a transfer.Plan, with CRC-32C checksums, reads them
// back into other memory and checks bytes and checksums.
//
// It is a module of its own (go.mod replaces github.com/kvhost/kvhost
// with this checkout), so it can import only kvhost's public packages:
// layering_test.go at the repository root builds it to keep them
// usable from outside.
package main

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"slices"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

func main() {
	if err := run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

// plan lays three 4 KiB extents of mem, each feeding its own checksum,
// end to end in a file.
func plan(mem region.Region) *transfer.Plan {
	p := &transfer.Plan{Sums: 3}
	for i := range int64(3) {
		p.Extents = append(p.Extents, transfer.Extent{
			FileOff: i * 4096, Region: mem, RegionOff: (2 - i) * 8192, Len: 4096, Sum: int(i),
		})
	}
	return p
}

func run(ctx context.Context) error {
	mv, err := staging.NewMover(staging.Config{Workers: 2})
	if err != nil {
		return fmt.Errorf("staging: %w", err)
	}
	defer mv.Close()

	src, err := region.NewHost("embed-src", 3*8192)
	if err != nil {
		return err
	}
	defer src.Close()
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*7 + i/4096)
	}
	dst, err := region.NewHost("embed-dst", 3*8192)
	if err != nil {
		return err
	}
	defer dst.Close()

	dir, err := os.MkdirTemp("", "embed-staging-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	f, err := fsys.OS{}.OpenFile(filepath.Join(dir, "blocks"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()

	wrote := make([]uint32, 3)
	n, err := mv.WriteFile(ctx, f, plan(src), wrote)
	if err != nil {
		return fmt.Errorf("write: %w", err)
	}
	read := make([]uint32, 3)
	if _, err := mv.ReadFile(ctx, f, plan(dst), read); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	for _, x := range plan(src).Extents {
		at := src.Bytes()[x.RegionOff : x.RegionOff+x.Len]
		if !bytes.Equal(at, dst.Bytes()[x.RegionOff:x.RegionOff+x.Len]) {
			return fmt.Errorf("extent at file offset %d: bytes differ", x.FileOff)
		}
	}
	if !slices.Equal(wrote, read) {
		return fmt.Errorf("read back checksums %08x, wrote %08x", read, wrote)
	}
	fmt.Printf("%s moved %d bytes each way; checksums %08x\n", mv.Name(), n, wrote)
	return nil
}
