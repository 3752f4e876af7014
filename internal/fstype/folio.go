package fstype

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Where the kernel says how tmpfs uses huge pages (transhuge(7)).
const (
	shmemEnabledPath = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
	pmdSizePath      = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
)

// MaxLargeFolio is the largest folio LargeFolio reports. A larger one
// (512 MiB with 64 KiB base pages on arm64) is beyond any write kvhost
// makes, so such mounts count as small-page ones.
const MaxLargeFolio = 32 << 20

// LargeFolio returns the size of the page-cache folios that writes to a
// file of m allocate when they are larger than a page, or 0. It is the
// huge page size (pmd, hpage_pmd_size) on a tmpfs that the kernel lets
// put huge pages under files written with write(2): one mounted with
// huge=always or huge=within_size (within the file's size, which kvhost
// sets first with fallocate), or any tmpfs while shmem_enabled (the
// setting in /sys/kernel/mm/transparent_hugepage, its choice in brackets)
// is force, none while it is deny. huge=advise gives huge pages only to
// mappings that ask for them, so writes get small ones.
//
// A write that covers only part of such a folio, the first one into it,
// makes the kernel zero the rest of it: a store that writes a file in
// pieces smaller than its folios, or not aligned to them, writes much of
// it twice.
func LargeFolio(m Mount, shmemEnabled string, pmd int64) int64 {
	if m.Type != "tmpfs" || pmd <= 0 || pmd > MaxLargeFolio {
		return 0
	}
	switch selected(shmemEnabled) {
	case "deny":
		return 0
	case "force":
		return pmd
	}
	if _, asks := HugeOption(m); asks {
		return pmd
	}
	return 0
}

// HugeOption returns m's huge= option ("never", tmpfs's default, where it
// has none) and whether it asks for huge pages under files written with
// write(2): always or within_size.
func HugeOption(m Mount) (huge string, asks bool) {
	huge, set := m.Option("huge")
	if !set {
		huge = "never"
	}
	return huge, huge == "always" || huge == "within_size"
}

// selected returns the bracketed choice of a sysfs setting ("always
// within_size advise [never] deny force" is "never"), or s trimmed where
// nothing is bracketed.
func selected(s string) string {
	if i := strings.IndexByte(s, '['); i >= 0 {
		if j := strings.IndexByte(s[i:], ']'); j > 0 {
			return s[i+1 : i+j]
		}
	}
	return strings.TrimSpace(s)
}

// LargeFolioOf is LargeFolio for the mount that holds path, with this
// machine's settings. Where those cannot be read (a kernel without
// transparent huge pages, or a container that hides them), it returns 0,
// and an error only if the mount asks for huge pages, which the kernel
// may then give it unseen.
func LargeFolioOf(path string) (int64, error) {
	m, err := MountOf(path)
	if err != nil {
		return 0, err
	}
	return LargeFolioOfMount(m)
}

// LargeFolioOfMount is LargeFolioOf for a mount already found (MountOf).
func LargeFolioOfMount(m Mount) (int64, error) { return largeFolioFor(m, hugeSettings) }

// largeFolioFor is LargeFolioOfMount with the settings read by settings.
func largeFolioFor(m Mount, settings func() (string, int64, error)) (int64, error) {
	if m.Type != "tmpfs" {
		return 0, nil
	}
	en, pmd, err := settings()
	if err != nil {
		if v, asks := HugeOption(m); asks {
			return 0, fmt.Errorf("fstype: %s is mounted with huge=%s, but the kernel's settings cannot be read: %w", m.Point, v, err)
		}
		return 0, nil
	}
	return LargeFolio(m, en, pmd), nil
}

// hugeSettings reads shmem_enabled and the huge page size.
func hugeSettings() (shmemEnabled string, pmd int64, err error) {
	en, err := os.ReadFile(shmemEnabledPath)
	if err != nil {
		return "", 0, err
	}
	ps, err := os.ReadFile(pmdSizePath)
	if err != nil {
		return "", 0, err
	}
	pmd, err = strconv.ParseInt(strings.TrimSpace(string(ps)), 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("%s: %w", pmdSizePath, err)
	}
	return string(en), pmd, nil
}
