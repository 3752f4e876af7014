package engine

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// checker checks that an indexed entry's file is still the one indexed:
// a lookup's stat (verify, skipped within the verify interval), a pin's
// stat or open (verifyPinned), a load's open (openLoad). A file found
// vanished or replaced has its entry dropped (judgeCheck).
type checker struct {
	fs   fsys.FS
	now  func() time.Time
	log  *slog.Logger
	ix   *index.Index
	hd   *headerReader // the opens, and the mounts
	pins *pinTable     // the files client pins hold open
	rm   *remover      // dropping a vanished file's entry

	// interval is Config.VerifyInterval, changed by SetVerifyInterval.
	interval atomic.Int64
}

// verify checks, cheaply (one stat), that en's file is still the one
// indexed. A file removed or replaced behind the engine's back drops the
// entry; verify then reports false.
func (c *checker) verify(ctx context.Context, en *entry) bool {
	fi, err := c.fs.Stat(en.Path)
	if err == nil {
		var id fsys.Identity
		if id, err = fsys.IdentityOf(fi); err == nil {
			if id.Same(en.Ident) {
				en.Verified.Store(c.now().UnixNano())
				return true
			}
			err = errReplaced
		}
	}
	return c.judgeCheck(ctx, en, err)
}

// recentlyVerified reports whether en's file was checked within
// Config.VerifyInterval of now (Unix nanoseconds).
func (c *checker) recentlyVerified(en *entry, now int64) bool {
	iv := c.interval.Load()
	return iv > 0 && now-en.Verified.Load() < iv
}

// verifyPinned is Pin's check of en's file, which the pin holds now (its
// lease counted): a stat (verify), or, where another engine may remove the
// file and none of en's pins holds it open yet, an open that then holds
// it (pinnedFile). Like verify, it drops an entry whose file vanished or
// was replaced, and reports false.
func (c *checker) verifyPinned(ctx context.Context, en *entry) bool {
	m := c.hd.mounts[en.Mount]
	if !m.othersRemove(en) {
		return c.verify(ctx, en)
	}
	if en.File.Load() != nil {
		// An earlier pin holds the file: this pin is checked by name,
		// and a file no longer there is a miss for it (the earlier
		// pins still load it).
		return c.verify(ctx, en)
	}
	if !c.pins.openSlot() {
		return c.verify(ctx, en)
	}
	f, id, idErr, err := c.hd.openData(m, en.Path, loadFlag(m))
	if err == nil && idErr != nil {
		err = idErr
	}
	if err == nil && !id.Same(en.Ident) {
		err = errReplaced
	}
	if err != nil {
		if f != nil {
			f.Close()
		}
		c.pins.closeSlot()
		return c.judgeCheck(ctx, en, err)
	}
	en.Verified.Store(c.now().UnixNano())
	c.pins.holdOpen(en, f)
	return true
}

// judgeCheck is what a failed check of en's file (err: a stat or open of
// its name failed, or found another file there: errReplaced,
// errNotRegular) does: it drops the entry of a file vanished or replaced,
// unless this engine removed or moved it meanwhile, and keeps it on an
// error that tells nothing (EIO, EACCES). It reports false.
func (c *checker) judgeCheck(ctx context.Context, en *entry, err error) bool {
	if c.ix.Files().Gone(en) {
		return false // removed or moved (demote.go) since it was found: not vanished
	}
	why := "vanished"
	switch {
	case errors.Is(err, errReplaced):
		why = "replaced"
	case errors.Is(err, errNotRegular):
		why = "not a regular file"
	case errors.Is(err, os.ErrNotExist), errors.Is(err, syscall.ELOOP):
	default:
		// Cannot tell (EIO, EACCES...): a miss for now, but keep the entry.
		c.log.Warn("engine: check of an indexed file", "path", en.Path, "err", err)
		return false
	}
	c.rm.dropVanished(ctx, en, why)
	return false
}

// openLoad opens en's file for a load: through the file its client pins
// hold open (pinnedRef), or by its name (openData), buffered (without
// O_DIRECT) where asked. It takes no lock: a
// load of a file no pin holds open pays one atomic load for it.
func (c *checker) openLoad(m *mount, en *entry, buffered bool) (f fsys.File, id fsys.Identity, idErr, err error) {
	pf := en.File.Load()
	if pf == nil || !pf.Acquire() {
		flag := loadFlag(m)
		if buffered {
			flag = os.O_RDONLY
		}
		return c.hd.openData(m, en.Path, flag)
	}
	id, idErr = fileIdentity(pf.File())
	return &pinnedRef{File: pf.File(), t: c.pins, pf: pf}, id, idErr, nil
}
