package main

import (
	"github.com/kvhost/kvhost/internal/fstype"
)

// ownTmpfs are the commands that give kvhost a tmpfs of its own with huge
// pages, as docs/serve.md gives them: mode=0750, since a tmpfs root is
// otherwise 1777 (anyone may write there).
const ownTmpfs = "mkdir -p /mnt/kvcache && mount -t tmpfs -o size=64G,huge=within_size,mode=0750 tmpfs /mnt/kvcache"

// hugePagesFinding judges the pages of the tmpfs mount holding path, by
// the rule the engine uses to cut its stores (fstype.LargeFolio): the
// mount's huge= option and the kernel's shmem_enabled. It says nothing
// where the mount cannot be read, and says so where the kernel's settings
// cannot be read for a mount that asks for huge pages.
func hugePagesFinding(path string) (level, what, fix string) {
	m, err := fstype.MountOf(path)
	if err != nil || m.Type != "tmpfs" {
		return "", "", ""
	}
	folio, err := fstype.LargeFolioOfMount(m)
	if err != nil {
		return levelInfo, "tmpfs whose huge pages kvhost cannot see: " + err.Error() + "; stores write as on 4 KiB pages",
			"let the daemon read /sys/kernel/mm/transparent_hugepage (shmem_enabled, hpage_pmd_size)"
	}
	return hugePagesJudgement(m, folio)
}

// hugePagesJudgement judges tmpfs mount m whose writes allocate folios of
// folio bytes (0: small pages). On the GPU machine a tmpfs with huge pages
// stored 32 MiB keys from GPU memory 1.2–1.5× and loaded them 1.6–1.9×
// faster than one with 4 KiB pages (docs/performance.md), and a first read
// of freshly written files ran 2.6–3.0× faster: the kernel's per-page work
// (allocation, the page cache, its LRU lists) dominates tmpfs I/O.
func hugePagesJudgement(m fstype.Mount, folio int64) (level, what, fix string) {
	huge, asked := fstype.HugeOption(m)
	mountFix := "remount it with huge pages (mount -o remount,huge=within_size " + m.Point + "), or give kvhost a tmpfs of its own: " + ownTmpfs
	switch {
	case folio > 0 && asked:
		return levelOK, "tmpfs with huge pages (huge=" + huge + ")", ""
	case folio > 0:
		return levelOK, "tmpfs with huge pages (huge=" + huge + ", but the kernel forces them: shmem_enabled is force)", ""
	case asked:
		return levelInfo, "tmpfs mounted with huge=" + huge + ", but no huge pages that kvhost's stores fill: the kernel's shmem_enabled is deny, or its huge pages are larger than 32 MiB",
			"where shmem_enabled (/sys/kernel/mm/transparent_hugepage) is deny, set it to anything else: the mount's option then counts"
	}
	return levelInfo, "tmpfs with 4 KiB pages (huge=" + huge + "): with huge pages, stores ran 1.2–1.5× and loads 1.6–1.9× faster on the GPU test machine, a first read of freshly written files 2.6–3.0×",
		mountFix
}
