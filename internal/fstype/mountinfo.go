package fstype

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Mount is one line of /proc/self/mountinfo: where a file system is
// mounted, its type as the kernel names it ("ext4", "fuse.ceph-fuse") and
// its source ("/dev/nvme0n1p1", "ceph-fuse", "server:/volume"), and the
// device it is on as "major:minor", and its super options as the kernel
// lists them ("rw,size=4194304k,huge=within_size").
type Mount struct {
	Point   string // mount point, octal escapes decoded
	Type    string // file system type ("ext4", "fuse.ceph-fuse")
	Source  string // mount source ("/dev/nvme0n1p1", "server:/volume"), escapes decoded
	Dev     string // device as "major:minor"
	Options string // super options ("rw,size=4194304k"); empty if the line has none
}

// Option returns the value of the super option key ("huge" of
// "rw,huge=within_size" is "within_size"), and whether the option is set.
func (m Mount) Option(key string) (string, bool) {
	for _, o := range strings.Split(m.Options, ",") {
		k, v, _ := strings.Cut(o, "=")
		if k == key {
			return v, true
		}
	}
	return "", false
}

// Subtype is a FUSE mount's file system: the part after "fuse." of its
// type ("ceph-fuse", "glusterfs", "sshfs"), or its source where the type
// is plain "fuse" or "fuseblk"; "" for a mount that is not FUSE.
func (m Mount) Subtype() string {
	switch {
	case strings.HasPrefix(m.Type, "fuse."):
		return strings.TrimPrefix(m.Type, "fuse.")
	case strings.HasPrefix(m.Type, "fuseblk."):
		return strings.TrimPrefix(m.Type, "fuseblk.")
	case m.Type == "fuse" || m.Type == "fuseblk":
		return m.Source
	}
	return ""
}

// errMountInfo: a mountinfo line is not in the kernel's format.
var errMountInfo = errors.New("fstype: malformed mountinfo line")

// ParseMountInfo reads mountinfo lines (proc(5)): mount ID, parent ID,
// major:minor, root, mount point, options, optional fields up to "-",
// type, source, super options. Octal escapes (\040 for a space) in the
// mount point and source are decoded.
func ParseMountInfo(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 6 || sep < 0 || sep+2 >= len(f) {
			return nil, fmt.Errorf("%w %d: %q", errMountInfo, n, sc.Text())
		}
		mt := Mount{Point: unescape(f[4]), Type: f[sep+1], Source: unescape(f[sep+2]), Dev: f[2]}
		if sep+3 < len(f) {
			mt.Options = f[sep+3]
		}
		out = append(out, mt)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("fstype: reading mountinfo: %w", err)
	}
	return out, nil
}

// unescape decodes mountinfo's \NNN octal escapes.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Containing returns the mount of mounts that holds path (absolute, with
// symbolic links resolved): the one with the longest mount point that is
// path or one of its parents, the last listed where several share it
// (a later mount hides an earlier one). ok is false when none does.
func Containing(mounts []Mount, path string) (m Mount, ok bool) {
	best := -1
	for _, c := range mounts {
		p := c.Point
		if path == p || p == "/" || strings.HasPrefix(path, strings.TrimSuffix(p, "/")+"/") {
			if len(p) >= best {
				m, ok, best = c, true, len(p)
			}
		}
	}
	return m, ok
}

// MountOf returns the mount that holds path, from /proc/self/mountinfo.
func MountOf(path string) (Mount, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return Mount{}, fmt.Errorf("fstype: %w", err)
	}
	if r, err := filepath.EvalSymlinks(abs); err == nil {
		abs = r
	}
	ms, err := Mounts()
	if err != nil {
		return Mount{}, err
	}
	m, ok := Containing(ms, abs)
	if !ok {
		return Mount{}, fmt.Errorf("fstype: no mount in /proc/self/mountinfo holds %s", abs)
	}
	return m, nil
}

// Mounts reads this process's mounts from /proc/self/mountinfo.
func Mounts() ([]Mount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("fstype: %w", err)
	}
	defer f.Close()
	return ParseMountInfo(f)
}
