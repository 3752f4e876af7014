package bench

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// fsNames are the statfs f_type magic numbers of file systems kvhost meets.
var fsNames = map[int64]string{
	0xEF53:     "ext4", // ext2/3/4 share the magic
	0x58465342: "xfs",
	0x9123683E: "btrfs",
	0x01021994: "tmpfs",
	0x6969:     "nfs",
	0x0BD00BD0: "lustre",
	0x47504653: "gpfs",
	0x794C7630: "overlay",
	0x65735546: "fuse",
	0x2FC12FC1: "zfs",
	0x858458F6: "ramfs",
	0x5346544E: "ntfs",
	0xFE534D42: "smb2",
	0xA501FCF5: "weka",
	0x19830326: "beegfs",
	0x00C36400: "cephfs",
}

// FSType names the file system holding path ("ext4", "tmpfs"), or gives
// its magic number in hex when it is not one kvhost knows.
func FSType(path string) (string, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return "", fmt.Errorf("bench: statfs %s: %w", path, err)
	}
	if n, ok := fsNames[int64(st.Type)]; ok {
		return n, nil
	}
	return fmt.Sprintf("0x%x", uint64(st.Type)), nil
}
