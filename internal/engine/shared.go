package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/format"
)

// The shared-directory seam (docs/engine.md, "The shared-directory
// seam"). A mount's directory may be shared with other engines (the nodes
// of a cluster mount, or of any network file system): a file may appear
// there that this engine never wrote (discover, adopt), vanish or be
// replaced behind its back, at the same inode even (vanished, replaced),
// or be rewritten while it is read (a spare reused by another engine:
// rewritten). The load and store paths (load.go, store.go) call these
// methods at the points where such a case can show; each says what the
// path does next, so that the paths read as the common case.

// sharedDir is the seam: the cases of a directory other engines share.
// Open sets it once its mounts are open; warm is set once the warmer
// starts (nil before: discover, its one user, is a request's).
type sharedDir struct {
	nm     *namer        // names a key's file (discover)
	ix     *index.Index  // the entries and the paths jobs hold
	hd     *headerReader // opens the files and reads their headers
	rm     *remover      // drops the entries of files gone or replaced
	tables *tables       // the namespace of an adopted file
	fs     fsys.FS       // stats a file found before its read was marked
	mounts []*mount      // the engine's: a cluster mount's purges
	warm   *warmer       // told of the files discovered; nil where none takes them
	log    *slog.Logger
	now    func() time.Time
	// tell reports events to the policy (Engine.access).
	tell func(context.Context, []abi.AccessRecord)
}

// discover looks for key under its policy name and indexes the file if its
// header says it holds the key in this geometry.
func (s *sharedDir) discover(ctx context.Context, ns *namespace, key []byte) *entry {
	mounts, paths, errs, err := s.nm.names(ctx, ns, [][]byte{key})
	if err != nil || errs[0] != nil {
		return nil
	}
	read := s.ix.Flights().BeginRead(paths[0])
	if read == nil { // held: adopt looks again
		return nil
	}
	defer s.ix.Flights().EndRead(paths[0], read)
	en, err := s.hd.readEntry(mounts[0], paths[0])
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			s.log.Debug("engine: not a match", "path", paths[0], "err", err)
		}
		return nil
	}
	if _, err := matchKey(en, ns.fp, key); err != nil {
		s.log.Info("engine: file under the key's name belongs to another key or geometry", "path", paths[0], "err", err)
		return nil
	}
	if purgedOnCluster(s.mounts, s.now(), en) { // its node removes it at its next interval
		s.log.Debug("engine: file of a purged namespace, written before the purge", "path", paths[0])
		return nil
	}
	got, _ := s.adopt(ctx, en, read)
	if got == en {
		// Another process's or node's file, new to the index: its
		// first load need not go through the pinned buffers.
		s.warm.discovered(en)
	}
	return got
}

// errPathHeld says that a job of this engine holds a file's path, or
// held it since the file was read: what the job leaves there (the file,
// a file that replaced it, or none) is the job's to index (adopt).
var errPathHeld = errors.New("engine: a job of this engine holds the path")

// adopt indexes an entry found on disk and tells the policy. It returns
// the indexed entry, or nil and errPathHeld where a job of this engine
// holds the path (a store about to publish there, a removal): only the
// holder indexes a file at a path it holds, so that a store's view of the
// file it replaces (group.old) stays true until it publishes. It returns
// errPathHeld too where read, the read of the file (nil: none), went
// stale: a job of this engine held the path since, and may have removed
// or replaced the file. It returns nil and no error where the file is one
// this engine dropped and could not remove (index.Leaving's left): its keys were
// deleted or evicted, and stay so.
func (s *sharedDir) adopt(ctx context.Context, en *entry, read *readMark) (*entry, error) {
	en.NS = uint32(s.tables.namespaceOf(en.FP))
	defer s.tables.adoptDone(NamespaceID(en.NS))
	got, res, recs := s.ix.Adopt(en, read)
	switch res {
	case adoptHeld:
		return nil, errPathHeld
	case adoptLeft:
		return nil, nil
	}
	s.tell(ctx, recs)
	return got, nil
}

// adoptFound is adopt for an entry of a file that was read before any
// mark of its path (a load that found its file replaced, the cluster
// adoption walk, which reads every file to find a dead node's): it marks
// a read now (index.beginRead), then indexes the file only if the stat of
// its name still finds it, in the state read. A job of this engine that
// claimed the path since the file was read has removed or replaced it
// (the stat shows it), or holds the path still or claims it before the
// insert (the mark shows it). It returns nil where it did not index the
// file, with errPathHeld where a job holds or held the path (what is
// there is the job's to tell) and the stat's error where it failed; with
// no error where the file was replaced since it was read, or is one this
// engine dropped (adopt).
func (s *sharedDir) adoptFound(ctx context.Context, found *entry) (*entry, error) {
	read := s.ix.Flights().BeginRead(found.Path)
	if read == nil { // held: adopt looks again
		return nil, errPathHeld
	}
	defer s.ix.Flights().EndRead(found.Path, read)
	fi, err := s.fs.Stat(found.Path)
	if err != nil {
		return nil, err
	}
	if id, err := fsys.IdentityOf(fi); err != nil || !id.Same(found.Ident) {
		return nil, err
	}
	return s.adopt(ctx, found, read)
}

// vanished is what a load does where the open of en's file failed (err,
// from openLoad): a file gone from its name, or a name that is not a
// regular file, or a link planted in its place, is a miss and its entry
// goes (counted vanished unless this engine removed it meanwhile: a
// delete, a purge); any other error fails the keys and keeps the entry.
func (s *sharedDir) vanished(ctx context.Context, en *entry, err error) (Outcome, error) {
	why := "vanished"
	switch {
	case errors.Is(err, errNotRegular):
		why = "not a regular file"
	case errors.Is(err, os.ErrNotExist), errors.Is(err, syscall.ELOOP):
		err = fmt.Errorf("%s vanished (removed behind this engine's back)", en.Path)
	default:
		return OutcomeFailed, fmt.Errorf("engine: load %s: %w", en.Path, err)
	}
	if !s.rm.dropVanished(ctx, en, why) {
		return OutcomeMissing, fmt.Errorf("%w: %s was deleted (a delete or purge) before the load read it", ErrNotFound, en.Path)
	}
	return OutcomeMissing, fmt.Errorf("%w: %w", ErrNotFound, err)
}

// replaced is what a load does once it has read the header h of the file
// it opened for en (identity id, idErr where the fstat failed): the file
// at the path may be another engine's since en was indexed, at the same
// inode even. A file of another geometry is a miss (error), and en goes;
// another file of this geometry replaces en in the index (adoptFound) and
// is what the load reads: the entry returned. A vllm-fs row longer than
// its length is not this geometry's (error).
func (s *sharedDir) replaced(ctx context.Context, ns *namespace, m *mount, en *entry, h *format.Header, id fsys.Identity, idErr error) (*entry, error) {
	g := ns.geo
	if h.Fingerprint != ns.fp || !ofGeometry(h, g) {
		// Replaced by a file of another geometry: not ours to judge.
		s.rm.dropVanished(ctx, en, "replaced by another geometry")
		return en, fmt.Errorf("%w: %w: %s was replaced by a file of another geometry: %w", ErrNotFound, ErrMismatch, en.Path, format.ErrFingerprint)
	}
	if idErr != nil || sameFile(en, id, h) {
		return en, nil
	}
	// Another file at the path (another node published there, maybe at
	// the same inode): the entry goes; the file is indexed anew if it
	// holds what is asked, and read like any file. The removal feed is
	// told of the keys the new file does not hold, once it is indexed.
	if s.rm.dropReplaced(ctx, en, "replaced") {
		defer s.rm.published(en, removals.Vanished)
	}
	// A row is exactly its length (rawEntry); a longer file is not this
	// geometry's row, whatever its first bytes.
	if m.raw != nil && id.Size > h.FileLen() {
		return en, fmt.Errorf("%w: %w: %s was replaced by a file of %d bytes, rows are %d", ErrNotFound, ErrMismatch, en.Path, id.Size, h.FileLen())
	}
	if id.Size < h.FileLen() {
		return en, nil // truncated: the load judges it corrupt
	}
	found := s.hd.entryOf(en.Mount, en.Path, h, id)
	if got, _ := s.adoptFound(ctx, found); got != nil {
		return got, nil
	}
	// A job of this engine holds the path, or held it since the file
	// was opened: the file is read, and left to it to index, replace or
	// remove.
	found.SetGone()
	return found, nil
}

// rewritten reports whether f, en's file, whose header h a load read
// before its payload, was rewritten while it was read (another engine on
// the directory evicted it and a store of it wrote into it: spare
// files); en then goes, and the bytes read may be another key's,
// checksums or not.
func (s *sharedDir) rewritten(ctx context.Context, en *entry, m *mount, f fsys.File, h *format.Header) bool {
	if !s.hd.rewrittenUnder(m, f, h) {
		return false
	}
	s.rm.dropVanished(ctx, en, "rewritten while read")
	return true
}

// confirm checks, reading the header, that en's file is still the one
// indexed; a file removed or replaced drops the entry (false), and counts
// it vanished unless this engine dropped it first (a move, a delete, an
// eviction since it was found). It is the check before a store answers
// present. An I/O error other than "not found" is false but keeps the
// entry.
func (s *sharedDir) confirm(ctx context.Context, en *entry) bool {
	f, _, err := s.hd.openSame(en, os.O_RDONLY)
	if err == nil {
		f.Close()
		en.Verified.Store(s.now().UnixNano())
		return true
	}
	switch {
	case errors.Is(err, os.ErrNotExist), errors.Is(err, errReplaced):
		s.rm.dropVanished(ctx, en, err.Error())
	default:
		s.log.Warn("engine: check of an indexed file", "path", en.Path, "err", err)
	}
	return false
}

// heldAt reports whether en, the indexed file at the path where a new
// file whose first key is key is about to be written (nil: none), holds
// key and is still there (its header is read). The index can lose a key of a file it holds: the
// key was indexed in another file too, which was dropped (another node's
// file holding it, deleted there). Writing would then replace a file that
// already holds the key, and every other key in it, some maybe answered
// present by this very store. The file's keys are indexed again instead.
// The caller holds the path.
func (s *sharedDir) heldAt(ctx context.Context, fp uint64, key []byte, en *entry) bool {
	if en == nil {
		return false
	}
	if _, err := matchKey(en, fp, key); err != nil || !s.confirm(ctx, en) {
		return false
	}
	return s.ix.Files().Relink(en)
}
