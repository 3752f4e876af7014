package main

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/fstype"
)

// TestProbeFlockFindsThatFlockExcludes: the probe passes where flock
// works, on a local directory and where an exclusive flock needs write
// access (an NFS version 4 client), and leaves no file behind.
func TestProbeFlockFindsThatFlockExcludes(t *testing.T) {
	tests := []struct {
		name string
		fs   fsys.FS
	}{
		{"local", fsys.OS{}},
		{"an exclusive flock needs write access (NFS)", fsystest.NFSLocks{FS: fsys.OS{}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := probeFlock(tc.fs, dir); err != nil {
				t.Fatalf("probeFlock: %v", err)
			}
			if tmp := tempFilesIn(t, dir); len(tmp) > 0 {
				t.Fatalf("the probe left %v", tmp)
			}
		})
	}
}

// tempFilesIn names the entries of dir.
func tempFilesIn(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestSharedFindingsNameTheFileSystemWhatGuardsOtherNodesStoresAndWhatPinsKeep(t *testing.T) {
	ceph := fstype.Mount{Point: "/mnt/cephfs", Type: "fuse.ceph-fuse", Source: "ceph-fuse"}
	gluster := fstype.Mount{Point: "/mnt/gv", Type: "fuse.glusterfs", Source: "srv:/gv"}
	sshfs := fstype.Mount{Point: "/mnt/s", Type: "fuse.sshfs", Source: "me@host:"}
	noFlock := errors.New("operation not supported")
	// want: each finding's level and a piece of its text, in order.
	type want struct{ level, text string }
	for _, c := range []struct {
		name     string
		magic    int64
		mnt      fstype.Mount
		mntErr   error
		flockErr error
		want     []want
	}{
		{"ext4", fstype.Ext4, fstype.Mount{Point: "/", Type: "ext4"}, nil, nil, nil},
		{"ceph-fuse", fstype.FUSE, ceph, nil, nil, []want{
			{levelInfo, "CephFS (ceph-fuse) through FUSE (f_type 0x65735546; fuse.ceph-fuse at /mnt/cephfs): the MDS's capabilities"},
			{levelOK, "excludes one through another"},
			{levelInfo, "past it a pin checks by name"},
			{levelInfo, "staging pipeline"},
		}},
		{"ceph-fuse without flock", fstype.FUSE, ceph, nil, noFlock, []want{
			{levelInfo, "CephFS"},
			{levelWarn, "only by temp_grace (10m0s)"},
			{levelInfo, "a client's pin holds open"},
			{levelInfo, "staging pipeline"},
		}},
		{"glusterfs", fstype.FUSE, gluster, nil, nil, []want{
			{levelWarn, "GlusterFS through FUSE"},
			{levelOK, "excludes one through another"},
			{levelInfo, "a client's pin holds open"},
			{levelInfo, "staging pipeline"},
		}},
		{"unknown FUSE", fstype.FUSE, sshfs, nil, nil, []want{
			{levelInfo, "sshfs through FUSE"},
			{levelInfo, "whether other nodes see it"},
			{levelInfo, "which kvhost does not know of it"},
			{levelInfo, "staging pipeline"},
		}},
		{"no mountinfo", fstype.FUSE, fstype.Mount{}, errors.New("no mount holds it"), nil, []want{
			{levelInfo, "which one is unknown: no mount holds it"},
			{levelInfo, "whether other nodes see it"},
			{levelInfo, "which kvhost does not know of it"},
			{levelInfo, "staging pipeline"},
		}},
		{"smb", 0xfe534d42, fstype.Mount{Point: "/mnt/s", Type: "cifs"}, nil, nil, []want{
			{levelInfo, "smb2: flock works on this node"},
			{levelInfo, "which kvhost does not know of it"},
			{levelInfo, "staging pipeline"},
		}},
		{"nfs", 0x6969, fstype.Mount{Point: "/mnt/n", Type: "nfs4", Options: "rw,vers=4.2,local_lock=none,addr=10.0.0.1"}, nil, nil, []want{
			{levelInfo, "nfs: flock works on this node"},
			{levelWarn, "gone under this node's open descriptors (ESTALE)"},
		}},
		{"nfs, local_lock=flock", 0x6969, fstype.Mount{Point: "/mnt/n", Type: "nfs4", Options: "rw,vers=4.2,local_lock=flock,addr=10.0.0.1"}, nil, nil, []want{
			{levelWarn, "mounted local_lock=flock: flocks stay on this node"},
			{levelWarn, "gone under this node's open descriptors (ESTALE)"},
		}},
		{"nfs, local_lock=all", 0x6969, fstype.Mount{Point: "/mnt/n", Type: "nfs", Options: "rw,vers=3,local_lock=all"}, nil, nil, []want{
			{levelWarn, "mounted local_lock=all: flocks stay on this node"},
			{levelWarn, "gone under this node's open descriptors (ESTALE)"},
		}},
		{"nfs, nolock", 0x6969, fstype.Mount{Point: "/mnt/n", Type: "nfs", Options: "rw,vers=3,nolock"}, nil, nil, []want{
			{levelWarn, "mounted nolock: flocks stay on this node"},
			{levelWarn, "gone under this node's open descriptors (ESTALE)"},
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := sharedFindings(c.magic, c.mnt, c.mntErr, c.flockErr, 10*time.Minute)
			if len(got) != len(c.want) {
				t.Fatalf("%d findings, want %d: %+v", len(got), len(c.want), got)
			}
			for i, w := range c.want {
				if got[i].Level != w.level || !strings.Contains(got[i].What, w.text) {
					t.Errorf("finding %d: %s %q; want %s containing %q", i, got[i].Level, got[i].What, w.level, w.text)
				}
				if got[i].Level == levelWarn && got[i].Fix == "" {
					t.Errorf("finding %d: a warning without a fix: %q", i, got[i].What)
				}
			}
		})
	}
}
