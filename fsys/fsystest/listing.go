package fsystest

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// ListingCache is a file system seen through one client that caches
// directory listings, as an NFS client may (mounted nocto, or where the
// server's directory mtime is too coarse to show a change): a directory
// listed before is listed again as it was then, however often it is
// opened anew, unless a file or directory was created, renamed or removed
// in it through this client since, which invalidates the cached listing.
// Changes through other clients (another FS on the same files) do not.
// Everything but listings goes to the file system underneath. It is safe
// for concurrent use.
type ListingCache struct {
	fsys.FS
	mu     sync.Mutex
	cached map[string][]fs.DirEntry // by directory
}

// NewListingCache returns a client of under that caches its listings.
func NewListingCache(under fsys.FS) *ListingCache {
	return &ListingCache{FS: under, cached: map[string][]fs.DirEntry{}}
}

// ReadDir lists name as this client last listed it, unless that listing
// was invalidated since (or there is none).
func (c *ListingCache) ReadDir(name string) ([]fs.DirEntry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ents, ok := c.cached[name]; ok {
		return ents, nil
	}
	ents, err := c.FS.ReadDir(name)
	if err == nil {
		c.cached[name] = ents
	}
	return ents, err
}

// changed invalidates the cached listing of the directory of path.
func (c *ListingCache) changed(path string) {
	c.mu.Lock()
	delete(c.cached, filepath.Dir(path))
	c.mu.Unlock()
}

// OpenFile opens name; a file it creates invalidates its directory's
// listing.
func (c *ListingCache) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	_, serr := c.FS.Stat(name)
	f, err := c.FS.OpenFile(name, flag, perm)
	if err == nil && flag&os.O_CREATE != 0 && errors.Is(serr, os.ErrNotExist) {
		c.changed(name)
	}
	return f, err
}

// Rename renames oldpath to newpath, invalidating both directories'
// listings.
func (c *ListingCache) Rename(oldpath, newpath string) error {
	err := c.FS.Rename(oldpath, newpath)
	if err == nil {
		c.changed(oldpath)
		c.changed(newpath)
	}
	return err
}

// RenameNoReplace renames oldpath to newpath unless newpath exists
// (fsys.NoReplacer, where the FS it wraps is one), invalidating both
// directories' listings.
func (c *ListingCache) RenameNoReplace(oldpath, newpath string) error {
	nr, ok := c.FS.(fsys.NoReplacer)
	if !ok {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: errors.ErrUnsupported}
	}
	err := nr.RenameNoReplace(oldpath, newpath)
	if err == nil {
		c.changed(oldpath)
		c.changed(newpath)
	}
	return err
}

// Remove removes name, invalidating its directory's listing.
func (c *ListingCache) Remove(name string) error {
	err := c.FS.Remove(name)
	if err == nil {
		c.changed(name)
	}
	return err
}

var _ fsys.AtFS = (*ListingCache)(nil)

// OpenAt opens as OpenFile does, path's name in dir, invalidating its
// directory's listing where it makes the file.
func (c *ListingCache) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	_, serr := fsys.StatAt(c.FS, dir, path)
	f, err := fsys.OpenAt(c.FS, dir, path, flag, perm)
	if err == nil && flag&os.O_CREATE != 0 && errors.Is(serr, os.ErrNotExist) {
		c.changed(path)
	}
	return f, err
}

// StatAt is the wrapped FS's (fsys.StatAt).
func (c *ListingCache) StatAt(dir fsys.File, path string) (os.FileInfo, error) {
	return fsys.StatAt(c.FS, dir, path)
}

// RemoveAt removes path's name in dir, invalidating its directory's
// listing.
func (c *ListingCache) RemoveAt(dir fsys.File, path string) error {
	err := fsys.RemoveAt(c.FS, dir, path)
	if err == nil {
		c.changed(path)
	}
	return err
}

// RenameAt renames as Rename and RenameNoReplace do, through the
// directories open as olddir and newdir, invalidating both listings.
func (c *ListingCache) RenameAt(olddir fsys.File, oldpath string, newdir fsys.File, newpath string, noReplace bool) error {
	err := fsys.RenameAt(c.FS, olddir, oldpath, newdir, newpath, noReplace)
	if err == nil {
		c.changed(oldpath)
		c.changed(newpath)
	}
	return err
}

// MkdirAt makes path's name in dir, invalidating its directory's
// listing.
func (c *ListingCache) MkdirAt(dir fsys.File, path string, perm os.FileMode) error {
	err := fsys.MkdirAt(c.FS, dir, path, perm)
	if err == nil {
		c.changed(path)
	}
	return err
}

// MkdirAll creates path and its missing parents, invalidating the
// listing of the directory of each it creates.
func (c *ListingCache) MkdirAll(path string, perm os.FileMode) error {
	var missing []string
	for d := filepath.Clean(path); ; d = filepath.Dir(d) {
		if _, err := c.FS.Stat(d); !errors.Is(err, os.ErrNotExist) || filepath.Dir(d) == d {
			break
		}
		missing = append(missing, d)
	}
	err := c.FS.MkdirAll(path, perm)
	for _, d := range missing {
		if _, serr := c.FS.Stat(d); serr == nil {
			c.changed(d)
		}
	}
	return err
}
