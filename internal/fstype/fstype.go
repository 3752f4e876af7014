// Package fstype names file systems by their statfs magic number (f_type)
// and says what kind each is: one table for the engine (device classes),
// cuFile (capability logs), the benchmark and the diagnostics.
package fstype

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Kind is what kvhost knows of a file system.
type Kind struct {
	// Name is the file system's usual name ("ext4", "tmpfs").
	Name string
	// Memory: its files live in memory (tmpfs, ramfs, hugetlbfs); its I/O
	// is a CPU copy even with O_DIRECT.
	Memory bool
	// Network: its files are shared with other nodes (NFS, Lustre, ...).
	Network bool
	// CuFileDirect: cuFile reaches it with nvidia-fs (GPUDirect, direct
	// mode); on others it runs in compatibility mode at best.
	CuFileDirect bool
	// CloseToOpen: its clients keep buffered writes and send them to
	// the server later (at fsync or close at the latest), but send a
	// rename at once (NFS's close-to-open consistency): another node can
	// see a file renamed into place before its data, short or with
	// holes, unless the writer flushes it before the rename.
	CloseToOpen bool
	// RemovalStales: a file removed through one client is gone at the
	// server at once, and the descriptors other clients hold open on it
	// fail (ESTALE): an open file does not keep it (NFS). On the other
	// file systems here an open descriptor keeps a removed file readable
	// until it is closed.
	RemovalStales bool
	// MapOnly: its files are written only through memory mappings;
	// write(2) refuses them (EINVAL), so kvhost, which writes its files
	// with pwrite, cannot store on it (hugetlbfs).
	MapOnly bool
	// Kernel: a kernel interface (proc, sysfs, cgroup, ...), not a file
	// system that keeps files: a directory there cannot hold kvhost's
	// files, or made at all.
	Kernel bool
}

// Magic numbers (statfs f_type).
const (
	Tmpfs     = 0x01021994
	Ramfs     = 0x858458f6
	Hugetlbfs = 0x958458f6
	Ext4      = 0xef53 // ext2 and ext3 share it
	XFS       = 0x58465342
	FUSE      = 0x65735546 // every FUSE file system: ceph-fuse, GlusterFS, sshfs, virtiofs, …
	NFS       = 0x6969
	// FakeOwner is Docker Desktop's bind mount of a directory of the
	// host (macOS, Windows) into a container: a layer over the VM's
	// share that shows the files as owned by the container's user. It is
	// not virtiofs, which is a FUSE file system and reports FUSE.
	FakeOwner = 0x6a656a63
)

var kinds = map[int64]Kind{
	Tmpfs:      {Name: "tmpfs", Memory: true},
	Ramfs:      {Name: "ramfs", Memory: true},
	Hugetlbfs:  {Name: "hugetlbfs", Memory: true, MapOnly: true},
	Ext4:       {Name: "ext4", CuFileDirect: true},
	XFS:        {Name: "xfs", CuFileDirect: true},
	0x9123683e: {Name: "btrfs"},
	0xf2f52010: {Name: "f2fs"},
	0x2fc12fc1: {Name: "zfs"},
	0x794c7630: {Name: "overlay"},
	0x5346544e: {Name: "ntfs"},
	FakeOwner:  {Name: "fakeowner"},
	NFS:        {Name: "nfs", Network: true, CuFileDirect: true, CloseToOpen: true, RemovalStales: true},
	0xfe534d42: {Name: "smb2", Network: true},
	0xff534d42: {Name: "cifs", Network: true},
	0x0bd00bd0: {Name: "lustre", Network: true, CuFileDirect: true},
	0x47504653: {Name: "gpfs", Network: true, CuFileDirect: true},
	0x00c36400: {Name: "ceph", Network: true},
	0x19830326: {Name: "beegfs", Network: true, CuFileDirect: true},
	0xa501fcf5: {Name: "weka", Network: true},
	FUSE:       {Name: "fuse", Network: true}, // FUSE file systems are mostly remote
	// Kernel interfaces (linux/magic.h).
	0x9fa0:     {Name: "proc", Kernel: true},
	0x62656572: {Name: "sysfs", Kernel: true},
	0x27e0eb:   {Name: "cgroup", Kernel: true},
	0x63677270: {Name: "cgroup2", Kernel: true},
	0x1cd1:     {Name: "devpts", Kernel: true},
	0x64626720: {Name: "debugfs", Kernel: true},
	0x74726163: {Name: "tracefs", Kernel: true},
	0x73636673: {Name: "securityfs", Kernel: true},
	0xcafe4a11: {Name: "bpf", Kernel: true},
	0x6165676c: {Name: "pstore", Kernel: true},
	0x62656570: {Name: "configfs", Kernel: true},
	0x19800202: {Name: "mqueue", Kernel: true},
	0x42494e4d: {Name: "binfmt_misc", Kernel: true},
	0xde5e81e4: {Name: "efivarfs", Kernel: true},
	0x65735543: {Name: "fusectl", Kernel: true},
	0xf97cff8c: {Name: "selinuxfs", Kernel: true},
	0x6e736673: {Name: "nsfs", Kernel: true},
}

// FUSEKind is what kvhost knows of a FUSE file system, by the subtype
// /proc/self/mountinfo gives it (Mount.Subtype): statfs says only "FUSE".
type FUSEKind struct {
	// Name is the file system as its users call it.
	Name string
	// SharedFlock: a flock taken through one client of the file system
	// excludes one taken through another client, as on another node
	// (checked on a test cluster: docs/cluster.md).
	SharedFlock bool
	// Coherence is what another client sees of files written, renamed
	// or removed through one, in a sentence.
	Coherence string
	// Advice, where not empty, is what to set for the clients to see
	// each other's files as kvhost needs (settings kvhost cannot read).
	Advice string
}

var fuseKinds = map[string]FUSEKind{
	"ceph-fuse": {
		Name:        "CephFS (ceph-fuse)",
		SharedFlock: true,
		Coherence:   "the MDS's capabilities make a rename or removal through one client visible to the next stat through another",
	},
	"glusterfs": {
		Name:        "GlusterFS",
		SharedFlock: true,
		Coherence:   "with its default caches a client can see stale sizes, removed entries and old versions of files renamed through another client",
		Advice:      "turn the client caches off: mount with attribute-timeout=0,entry-timeout=0,negative-timeout=0 and set the volume's performance caches off (docs/cluster.md lists them)",
	},
}

// FUSEOf is what kvhost knows of the FUSE file system subtype
// ("ceph-fuse"); ok is false for one it does not know.
func FUSEOf(subtype string) (k FUSEKind, ok bool) {
	k, ok = fuseKinds[subtype]
	return k, ok
}

// Of is the kind of file system magic; ok is false for one kvhost does
// not know.
func Of(magic int64) (k Kind, ok bool) {
	k, ok = kinds[magic]
	return k, ok
}

// Name names file system magic, or gives it in hex ("0x1234") when
// kvhost does not know it.
func Name(magic int64) string {
	if k, ok := kinds[magic]; ok {
		return k.Name
	}
	return fmt.Sprintf("0x%x", uint64(magic))
}

// OfPath statfs's path and names its file system.
func OfPath(path string) (magic int64, name string, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, "", fmt.Errorf("fstype: statfs %s: %w", path, err)
	}
	return int64(st.Type), Name(int64(st.Type)), nil
}
