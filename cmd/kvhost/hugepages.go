package main

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
)

// tmpfsHuge returns the huge= option of the mount holding path, read from
// mountinfo (the format of /proc/self/mountinfo), and its mount point:
// "never" where the mount has none (tmpfs's default). ok is false when no
// mount holds path.
func tmpfsHuge(mountinfo, path string) (huge, mountPoint string, ok bool) {
	best := -1
	sc := bufio.NewScanner(strings.NewReader(mountinfo))
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source superoptions
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || sep+3 >= len(f) {
			continue
		}
		mp := unescapeMount(f[4])
		// The longest mount point holding path wins; of mounts on the same
		// point, the last listed (the one on top, the one visible).
		if !within(path, mp) || len(mp) < best {
			continue
		}
		best, huge, mountPoint, ok = len(mp), "never", mp, true
		for _, o := range strings.Split(f[sep+3], ",") {
			if v, found := strings.CutPrefix(o, "huge="); found {
				huge = v
			}
		}
	}
	return huge, mountPoint, ok
}

// within reports whether path is mount point mp or below it.
func within(path, mp string) bool {
	if mp == "/" {
		return strings.HasPrefix(path, "/")
	}
	return path == mp || strings.HasPrefix(path, mp+"/")
}

// unescapeMount undoes mountinfo's octal escapes of space, tab, newline
// and backslash.
func unescapeMount(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}

// hugePagesFinding judges a tmpfs mount's huge page setting. On the GPU
// machine a tmpfs mounted with huge=always or huge=within_size stored
// 32 MiB keys from GPU memory 1.2–1.5× and loaded them 1.6–1.9× faster than
// one with 4 KiB pages (docs/performance.md): the kernel's per-page work
// (allocation, the page cache, LRU) dominates tmpfs I/O.
func hugePagesFinding(path string) (level, what, fix string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", "", ""
	}
	abs, err := filepath.EvalSymlinks(path)
	if err != nil {
		abs = path
	}
	huge, mp, ok := tmpfsHuge(string(b), abs)
	switch {
	case !ok:
		return "", "", ""
	case huge == "always" || huge == "within_size":
		return levelOK, "tmpfs with huge pages (huge=" + huge + ")", ""
	}
	return levelInfo, "tmpfs with 4 KiB pages (huge=" + huge + "): with huge pages, stores ran 1.2–1.5× and loads 1.6–1.9× faster on the GPU test machine",
		"remount it with huge pages (mount -o remount,huge=within_size " + mp + "), or give kvhost a tmpfs of its own: mount -t tmpfs -o size=64G,huge=within_size tmpfs /mnt/kvcache"
}
