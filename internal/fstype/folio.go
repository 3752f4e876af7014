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
	if m.Type != "tmpfs" || pmd <= 0 {
		return 0
	}
	switch selected(shmemEnabled) {
	case "deny":
		return 0
	case "force":
		return pmd
	}
	switch v, _ := m.Option("huge"); v {
	case "always", "within_size":
		return pmd
	}
	return 0
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
// machine's settings. A kernel without transparent huge pages (no
// settings to read) gives 0 and no error.
func LargeFolioOf(path string) (int64, error) {
	m, err := MountOf(path)
	if err != nil {
		return 0, err
	}
	if m.Type != "tmpfs" {
		return 0, nil
	}
	en, err := os.ReadFile(shmemEnabledPath)
	if os.IsNotExist(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("fstype: %w", err)
	}
	ps, err := os.ReadFile(pmdSizePath)
	if os.IsNotExist(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("fstype: %w", err)
	}
	pmd, err := strconv.ParseInt(strings.TrimSpace(string(ps)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("fstype: %s: %w", pmdSizePath, err)
	}
	return LargeFolio(m, string(en), pmd), nil
}
