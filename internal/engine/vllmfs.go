package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/vllmfs"
)

// vllm-fs mounts (docs/engine.md, "vllm-fs mounts").
//
// A mount with Mount.VLLMFS set holds vLLM's fs-tier directory: one base
// directory (config.json), one data directory of raw rows named by the
// layout. It serves exactly one namespace, whose files carry no header:
// their fingerprint is the mount's (layoutFingerprint), their key is their
// name, their length the row's padded to 4 KiB. The policy still admits,
// ranks and picks victims; it does not name files there.

// Layouts of Mount.Layout and MountStats.Layout.
const (
	LayoutKVHost = "kvhost"  // kvhost's own files (docs/format.md)
	LayoutVLLMFS = "vllm-fs" // vLLM's fs-tier layout (package internal/vllmfs)
)

// VLLMFS configures a vllm-fs mount.
type VLLMFS struct {
	// Fields are the fs tier's fields. nil adopts the one base directory
	// found under the mount's path (its config.json gives the fields).
	Fields *vllmfs.Fields
	// Rank is the data directory's rank (<base>_r<rank>): 0 for the tier.
	Rank int
	// Namespace is the model id (Geometry.Model) of the namespace the
	// mount serves; "" means "vllm-fs:" followed by the base directory's
	// name, cut to abi.MaxModelLen bytes where it is longer (the start of
	// the model's name is kept, and the "_<hash>" that ends it).
	Namespace string
	// RowBytes, if set, is the row size: the namespace's KeyBytes must
	// equal it, and files of another length are not indexed. 0 takes the
	// namespace's KeyBytes at Declare (files indexed earlier must then
	// have its length; shorter ones, rows cut short by a crash, are
	// removed: bindLayoutLocked).
	RowBytes int64
}

// ModelPrefix starts the default namespace model id of a vllm-fs mount.
const ModelPrefix = "vllm-fs:"

// defaultNamespace is the default namespace model id of a vllm-fs mount
// whose base directory is base: ModelPrefix and base, or, where that is
// longer than a model id may be (a model given by a long local path),
// ModelPrefix, the start of base's model name cut on a character boundary
// to fit, and base's "_<hash>". The hash covers every field, the whole
// model name included, so the cut keeps namespaces apart as the base
// directory's name does. kvhost.vllm computes the same id (vllm_fs).
func defaultNamespace(base string) string {
	id := ModelPrefix + base
	if len(id) <= abi.MaxModelLen {
		return id
	}
	tail := base[len(base)-1-vllmfs.HashLen:] // "_<hash>"
	n := abi.MaxModelLen - len(ModelPrefix) - len(tail)
	for n > 0 && !utf8.RuneStart(base[n]) {
		n--
	}
	return ModelPrefix + base[:n] + tail
}

// rawLayout is the state of a vllm-fs mount.
type rawLayout struct {
	cfg      vllmfs.Config
	layout   vllmfs.Layout
	model    string // the namespace served
	fp       uint64 // fingerprint of the mount's files
	rank     int
	rowBytes atomic.Int64 // 0: not known until the namespace is declared (set under the tables' lock)
}

// layoutFingerprintTag starts the fingerprint of a vllm-fs mount's files.
const layoutFingerprintTag = "kvhost/vllm-fs/v1\x00"

// layoutFingerprint identifies the files of one data directory: FNV-1a 64
// of the tag, the data directory's name (its length as uint32 LE, then
// its bytes) and the namespace's model id. The files have no header, but
// the Declared reply carries it, and clients check it to learn which
// directory serves their namespace (docs/protocol.md): it must never
// change.
func layoutFingerprint(dataDir, model string) uint64 {
	h := fnv.New64a()
	b := []byte(layoutFingerprintTag)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(dataDir)))
	b = append(b, dataDir...)
	b = append(b, model...)
	h.Write(b)
	return h.Sum64()
}

// vllmReader is the engine's part for vllm-fs mounts: it opens their
// base directories (openLayout), binds a namespace to a mount
// (bindLayoutLocked, dropShort) and makes the entries and headers of the
// row files, which hold none (rawEntry, rawHeader: headerReader's
// rawFiles). Open sets it before the mounts are opened, and adds each
// mount to mounts as it opens it.
type vllmReader struct {
	fs     fsys.FS
	mounts []*mount      // the engine's, as Open adds them
	own    *ownFiles     // the directories made and the temporary files' names
	hd     *headerReader // opens the row files
	ix     *index.Index  // the files indexed on a mount (bindLayoutLocked)
	rm     *remover      // drops the rows cut short (dropShort)
	tables *tables       // the namespace's geometry, once declared (rawHeader)
	fsync  bool          // Config.Fsync: config.json is synced as it is written
	// corrupt counts the rows cut short that dropShort removed (the
	// engine's Stats.Corrupt).
	corrupt *atomic.Uint64
	log     *slog.Logger
	now     func() time.Time
}

// openLayout reads or writes the base directory of a vllm-fs mount: with
// fields, their base directory's config.json must record them (written if
// absent, or anew if it does not parse: the tier writes it in place, so a
// crash can cut it), and no other base directory of the same model may sit
// under the root (a directory reused across geometries); without, the one
// base directory found is adopted. Mismatches are refused with the
// differing fields named; other base directories whose config.json cannot
// be used are skipped with a warning.
func (vr *vllmReader) openLayout(mt *mount, v *VLLMFS) error {
	fail := func(err error) error { return fmt.Errorf("%w: mount %s: vllm-fs: %w", ErrInvalid, mt.root, err) }
	if v.Rank < 0 || v.RowBytes < 0 {
		return fail(fmt.Errorf("rank %d, row bytes %d: want >= 0", v.Rank, v.RowBytes))
	}
	found, listed, err := baseDirs(vr.fs, mt.root)
	if err != nil {
		return fmt.Errorf("engine: mount %s: vllm-fs: %w", mt.root, err)
	}
	var cfg vllmfs.Config
	// skip warns of a base directory that is not served and whose
	// config.json cannot be used (the tier writes it in place, so a crash
	// can leave it empty or cut): it is no reason not to start.
	skip := func(name string) {
		if err := found[name].err; err != nil {
			vr.log.Warn("engine: vllm-fs: skipping a base directory whose config.json cannot be used", "mount", mt.root, "dir", name, "err", err)
		}
	}
	if v.Fields == nil {
		if _, cfg, err = adoptable(found); err != nil {
			return fail(err)
		}
		for _, name := range slices.Sorted(maps.Keys(found)) {
			skip(name)
		}
	} else {
		if cfg, err = vllmfs.FromFields(*v.Fields); err != nil {
			return fail(err)
		}
		base := cfg.Base()
		// The base directory is opened once, and its config.json read
		// and written relative to it: what is written goes where what
		// was read came from, whatever the name holds meanwhile. A link
		// at its name is the operator's, and followed, unless the
		// listing just showed a directory there: then it was put since.
		flag := 0
		if listed[base] {
			flag = syscall.O_NOFOLLOW
		}
		dir, c := openBase(vr.fs, mt.root, base, flag)
		if dir != nil {
			defer dir.Close()
		}
		ok := !errors.Is(c.err, fs.ErrNotExist)
		if ok {
			found[base] = c // a link at its name too (the operator's), which the listing skips
		}
		// One that does not parse (empty or cut by a crash) is written
		// anew below: the directory's name is the fields' hash. One that
		// parses but records other fields (edited), or that could not be
		// read, is refused.
		if ok && c.err != nil && !errors.Is(c.err, vllmfs.ErrConfig) {
			return fail(c.err)
		}
		for _, name := range slices.Sorted(maps.Keys(found)) {
			c := found[name]
			if name == base || c.err != nil || c.cfg.ModelName() != cfg.ModelName() {
				continue
			}
			return fail(fmt.Errorf("%w: %s/%s records another geometry of %q than configured (%s): reusing a directory across geometries corrupts output; fix the fields or use another root",
				vllmfs.ErrMismatch, name, vllmfs.ConfigFile, cfg.ModelName(), strings.Join(c.cfg.Diff(cfg), "; ")))
		}
		for _, name := range slices.Sorted(maps.Keys(found)) {
			if name != base {
				skip(name)
			}
		}
		if !ok || c.err != nil {
			if dir == nil {
				// Made here, so a link at its name now is not the
				// operator's: it is refused (O_NOFOLLOW).
				if err := vr.own.dirs.mkdir(nil, filepath.Join(mt.root, base), true); err != nil {
					return fmt.Errorf("engine: mount %s: vllm-fs: %w", mt.root, err)
				}
				var made baseConfig
				if dir, made = openBase(vr.fs, mt.root, base, syscall.O_NOFOLLOW); dir == nil {
					return fmt.Errorf("engine: mount %s: vllm-fs: %w", mt.root, made.err)
				}
				defer dir.Close()
			}
			if err := vr.writeConfig(dir, filepath.Join(mt.root, base), cfg); err != nil {
				return fmt.Errorf("engine: mount %s: vllm-fs: config.json: %w", mt.root, err)
			}
		}
		if ok && c.err != nil {
			vr.log.Warn("engine: vllm-fs: wrote the configured base directory's config.json anew (it did not parse: a crash while the tier wrote it)", "mount", mt.root, "dir", base, "err", c.err)
		}
	}
	layout, err := vllmfs.NewLayout(cfg, v.Rank)
	if err != nil {
		return fail(err)
	}
	model := v.Namespace
	if model == "" {
		model = defaultNamespace(layout.Base())
	}
	data := filepath.Join(mt.root, layout.DataDir())
	if err := vr.own.dirs.mkdir(nil, data, true); err != nil {
		return fmt.Errorf("engine: mount %s: vllm-fs: %w", mt.root, err)
	}
	// vLLM's directory is shared: below the data directory (the
	// operator's, as the root and base are, links included) no link is
	// followed (openNoLinks, openDir, mkdirIn).
	realData, err := filepath.EvalSymlinks(data)
	if err != nil {
		return fmt.Errorf("engine: mount %s: vllm-fs: %w", mt.root, err)
	}
	mt.linkFree, mt.realLinkFree = data, realData
	mt.checksums = false // the layout has none
	mt.raw = &rawLayout{cfg: cfg, layout: layout, model: model, fp: layoutFingerprint(layout.DataDir(), model), rank: v.Rank}
	mt.raw.rowBytes.Store(v.RowBytes)
	return nil
}

// AdoptedBase returns the name of the base directory that Open adopts
// under root, the root of a vllm-fs mount configured without the fs
// tier's fields, or the error Open stops on (none there, several, or none
// whose config.json hashes to its name): `kvhost check` asks it.
func AdoptedBase(root string) (string, error) {
	found, _, err := baseDirs(fsys.OS{}, root)
	if errors.Is(err, fs.ErrNotExist) {
		found, err = nil, nil // Open makes the root: none there
	}
	if err != nil {
		return "", err
	}
	name, _, err := adoptable(found)
	return name, err
}

// adoptable picks the one base directory of found that can be adopted,
// or says why there is none.
func adoptable(found map[string]baseConfig) (string, vllmfs.Config, error) {
	var ok []string
	for _, name := range slices.Sorted(maps.Keys(found)) {
		if found[name].err == nil {
			ok = append(ok, name)
		}
	}
	switch {
	case len(ok) == 1:
		return ok[0], found[ok[0]].cfg, nil
	case len(found) == 0:
		return "", vllmfs.Config{}, errors.New("no base directory with a config.json to adopt under the root; configure the fields")
	case len(ok) == 0:
		// Say why each one cannot be adopted: an edited config.json
		// reads fine but hashes to another name.
		var why []error
		for _, name := range slices.Sorted(maps.Keys(found)) {
			why = append(why, found[name].err)
		}
		return "", vllmfs.Config{}, fmt.Errorf("no base directory under the root can be adopted; configure the fields: %w", errors.Join(why...))
	}
	return "", vllmfs.Config{}, fmt.Errorf("%d base directories to adopt (%s): configure the fields of the one to serve", len(ok), strings.Join(ok, ", "))
}

// baseConfig is a base directory's config.json, or why it cannot be used.
type baseConfig struct {
	cfg vllmfs.Config
	err error
}

// baseDirs reads the config.json of every directory directly under root
// that has one: its fields must hash to the directory's name. Names
// starting with '.' are read too: vLLM names the base directory of a model
// given as a relative path ("./models/llama") "._models_llama_<hash>", and
// the engine's own names under a root are files, or a directory without a
// config.json (the cluster directory). listed is every name the listing
// showed as a directory, with a config.json or not: a symbolic link at
// one of them was put there since (openLayout).
func baseDirs(files fsys.FS, root string) (found map[string]baseConfig, listed map[string]bool, err error) {
	ents, err := files.ReadDir(root)
	if err != nil {
		return nil, nil, err
	}
	out, listed := map[string]baseConfig{}, map[string]bool{}
	for _, d := range ents {
		if !d.IsDir() {
			continue
		}
		listed[d.Name()] = true
		// Listed as a directory: a link at its name now was put there
		// since, and is not followed.
		dir, c := openBase(files, root, d.Name(), syscall.O_NOFOLLOW)
		if dir != nil {
			dir.Close()
		}
		if !errors.Is(c.err, fs.ErrNotExist) { // gone since, or without a config.json
			out[d.Name()] = c
		}
	}
	return out, listed, nil
}

// openBase opens the base directory name under root (O_RDONLY|O_DIRECTORY,
// with flag) and reads its config.json relative to it (readSmallAt): c is
// that file's fields, or why they cannot be used, an error matching
// fs.ErrNotExist where the directory or its config.json does not exist.
// dir is nil where the directory could not be opened (c.err says why);
// the caller closes it otherwise. Read and written relative to one
// descriptor (writeConfig), config.json is validated and written anew in
// the same directory, whatever its name holds meanwhile: a symbolic link
// put there after this open takes no write elsewhere. A link at name at
// this open is followed unless flag has O_NOFOLLOW: the base directory is
// the operator's, who may put it elsewhere by a link, as the root and the
// data directory; a directory listed as one, or made by the engine, is
// opened with O_NOFOLLOW (a link there was put since).
func openBase(files fsys.FS, root, name string, flag int) (dir fsys.File, c baseConfig) {
	path := filepath.Join(root, name)
	dir, err := files.OpenFile(path, os.O_RDONLY|syscall.O_DIRECTORY|flag, 0)
	if err != nil {
		c.err = fmt.Errorf("base directory %s: %w", path, err)
		return nil, c
	}
	p := filepath.Join(path, vllmfs.ConfigFile)
	data, err := readSmallAt(files, dir, p)
	if err == nil {
		if c.cfg, err = vllmfs.ParseConfig(data); err != nil {
			err = fmt.Errorf("%s: %w", p, err)
		}
	}
	switch {
	case err != nil:
		c.err = err // readSmallAt's errors name p
	case c.cfg.Base() != name:
		c.err = fmt.Errorf("%w: %s: its fields hash to %s, not to the directory's name (edited, or another vLLM version's hash)", vllmfs.ErrMismatch, p, c.cfg.Base())
	}
	return dir, c
}

// readSmallAt reads a config file (at most 1 MiB), path's last component
// in dir, the directory that holds it (fsys.OpenAt). Its errors name
// path; a read's error is returned as one (wrapped), never as the end of
// the file. A symbolic link at its name is refused (O_NOFOLLOW), with an
// error naming the path: the base directory is in vLLM's shared
// directory, where anyone who can write it may put one, and a config.json
// read through it would be a file outside the directory (the base
// directory itself is the operator's, and may be a link: openBase). So is
// anything but a regular file (a named pipe,
// a directory, a socket), checked on the open file; the open does not
// block (checkOpen), where a plain one of a named pipe waits for a
// writer, holding Open (and `kvhost check`) forever.
func readSmallAt(files fsys.FS, dir fsys.File, path string) ([]byte, error) {
	f, err := fsys.OpenAt(files, dir, path, os.O_RDONLY|syscall.O_NOFOLLOW|checkOpen, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("%s is a symbolic link: kvhost reads no config.json through one: %w", path, err)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := fsys.Fstat(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s (%v): kvhost reads no config.json from one", errNotRegular, path, fi.Mode().Type())
	}
	// A read's error is returned, never taken for the end of the file:
	// the bytes before it would not parse, and Open writes a config.json
	// that does not parse anew (a crash's cut), where one it cannot read
	// must be refused.
	buf := make([]byte, 1<<20+1)
	n := 0
	for n < len(buf) {
		m, err := f.ReadAt(buf[n:], int64(n))
		n += m
		if errors.Is(err, io.EOF) || (err == nil && m == 0) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", path, err)
		}
	}
	if n > 1<<20 {
		return nil, fmt.Errorf("%w: %s is larger than 1 MiB", vllmfs.ErrConfig, path)
	}
	return buf[:n], nil
}

// writeConfig publishes cfg's config.json in its base directory, open as
// dir (openBase) at path (a temporary file, then rename, both relative to
// dir: never through a link put at path since), as the tier writes it.
func (vr *vllmReader) writeConfig(dir fsys.File, path string, cfg vllmfs.Config) error {
	tmp := vr.own.tempName(path, tmpPrefix)
	f, err := fsys.OpenAt(vr.fs, dir, tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	data := cfg.JSON()
	_, err = f.WriteAt(data, 0)
	if err == nil && vr.fsync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fsys.RenameAt(vr.fs, dir, tmp, dir, filepath.Join(path, vllmfs.ConfigFile), false)
	}
	if err != nil {
		// Counted nowhere, as config.json is not: a removal that fails
		// is only logged (Open removes the file once this process is
		// gone).
		if rerr := fsys.RemoveAt(vr.fs, dir, tmp); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			vr.log.Warn("engine: remove a temporary file", "path", tmp, "err", rerr)
		}
		return err
	}
	if vr.fsync {
		return dir.Sync()
	}
	return nil
}

// layoutMount returns the vllm-fs mount serving model, or nil.
func (vr *vllmReader) layoutMount(model string) *mount {
	for _, m := range vr.mounts {
		if m.raw != nil && m.raw.model == model {
			return m
		}
	}
	return nil
}

// bindLayoutLocked checks that geometry g can be the namespace of vllm-fs mount
// m: one plane (the tier's row namespace, or MLA), so that its payload is
// the row in vLLM's order; the mount's rank; the row size; and the files
// already indexed there. Files shorter than the row are rows cut short (a
// power loss after the tier renamed a row it had not synced leaves it
// empty or cut): they are returned, for the caller to drop and remove
// once it has released the tables' lock (dropShort), as the tier removes a row it
// reads short. A file longer than the row, or only files of another
// length (none of the row's, some not empty), say that the directory
// holds another geometry: refused. Declare calls it under the tables' lock
// (tables.beginDeclare).
func (vr *vllmReader) bindLayoutLocked(m *mount, g Geometry) (short []*entry, err error) {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: namespace %q on vllm-fs mount %s: "+format, append([]any{ErrInvalid, g.Model, m.root}, args...)...)
	}
	r := m.raw
	switch {
	case g.Planes() != 1:
		return nil, fail("a K/V geometry has no place in vLLM's row: declare the row (one layer, one plane, one block of the row's bytes, as the vLLM tier does) or an MLA geometry")
	case g.TPRank != r.rank:
		return nil, fail("TP rank %d, but the mount's data directory is rank %d (%s)", g.TPRank, r.rank, r.layout.DataDir())
	case r.rowBytes.Load() != 0 && g.KeyBytes() != r.rowBytes.Load():
		return nil, fail("key bytes %d, but the mount's rows are %d bytes (row_bytes)", g.KeyBytes(), r.rowBytes.Load())
	}
	want := vllmfs.FileLen(g.KeyBytes())
	rows, longer, cut, example := 0, 0, 0, ""
	vr.ix.Files().Each(func(en *entry) {
		switch {
		case en.Mount != m.idx:
		case en.Size == want:
			rows++
		case en.Size > want:
			longer++
			example = fmt.Sprintf("%s is %d bytes", en.Path, en.Size)
		default:
			short = append(short, en)
			if en.Size > 0 {
				cut++
				if longer == 0 {
					example = fmt.Sprintf("%s is %d bytes", en.Path, en.Size)
				}
			}
		}
	})
	if bad := longer + cut; longer > 0 || rows == 0 && cut > 0 {
		return nil, fail("%d files of the directory are not rows of %d bytes (padded to %d), e.g. %s: the directory holds another geometry", bad, g.KeyBytes(), want, example)
	}
	r.rowBytes.Store(g.KeyBytes())
	return short, nil
}

// dropShort drops the entries of vllm-fs mount m that bindLayoutLocked
// found shorter than the row and removes their files (each if it is still
// the file indexed), counting them corrupt: the tier removes such a row
// when it reads it, and kvhost never serves one. The caller holds no lock.
func (vr *vllmReader) dropShort(ctx context.Context, m *mount, short []*entry) {
	n := 0
	for _, en := range short {
		if vr.rm.drop(ctx, en, true, "a vllm-fs row cut short") {
			n++
		}
	}
	if n == 0 {
		return
	}
	vr.corrupt.Add(uint64(n))
	vr.log.Warn("engine: vllm-fs: removed rows shorter than the namespace's row (cut short by a crash)", "mount", m.root, "rows", n, "row_bytes", m.raw.rowBytes.Load(), "e.g.", short[0].Path)
}

// rawEntry returns an unindexed entry for the row file at path on vllm-fs
// mount mnt, or an error wrapping vllmfs.ErrKey for a name that is not a
// row of the layout (vLLM's temporary files, other directories). A row
// that is a symbolic link, or whose name leads through one below the data
// directory, is refused (ELOOP, openNoLinks): its bytes are not vLLM's.
func (vr *vllmReader) rawEntry(mnt int, path string) (*entry, error) {
	m := vr.mounts[mnt]
	key, err := vr.rawKey(m, path)
	if err != nil {
		return nil, err
	}
	f, id, err := vr.hd.openRegular(m, path)
	if err != nil {
		return nil, err
	}
	f.Close()
	row := m.raw.rowBytes.Load()
	if row != 0 && id.Size != vllmfs.FileLen(row) {
		return nil, fmt.Errorf("%w: %s: %d bytes, rows are %d (padded to %d)", ErrMismatch, path, id.Size, row, vllmfs.FileLen(row))
	}
	en := &entry{FP: m.raw.fp, Mount: mnt, Path: path, Size: id.Size, Ident: id, Last: id.Mtime, Keys: []string{string(key)}}
	en.Verified.Store(vr.now().UnixNano())
	return en, nil
}

// rawKey is the key of the row file at path on vllm-fs mount m.
func (vr *vllmReader) rawKey(m *mount, path string) ([]byte, error) {
	rel, err := filepath.Rel(m.root, path)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", vllmfs.ErrKey, path, err)
	}
	return m.raw.layout.Key(filepath.ToSlash(rel))
}

// rawHeader is the header a row file would have: none is in the file
// (Header.Raw), so it is made from the mount's namespace and the file's
// name. Before the namespace is declared the geometry is one block of the
// file's length (only the fingerprint and key are used then).
func (vr *vllmReader) rawHeader(m *mount, path string, size int64) (*format.Header, error) {
	key, err := vr.rawKey(m, path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errReplaced, err)
	}
	h := &format.Header{Raw: true, Fingerprint: m.raw.fp, Order: format.OrderLayerMajor, Layers: 1, Planes: 1, BlocksPerKey: 1, BlockBytes: uint64(max(1, size)), Keys: []format.Key{{Key: key}}}
	if g, ok := vr.tables.declaredGeometry(m.raw.fp); ok {
		h.Layers, h.Planes, h.BlocksPerKey, h.BlockBytes = uint32(g.Layers), uint32(g.Planes()), uint32(g.BlocksPerKey()), uint64(g.BlockBytes())
	}
	return h, nil
}
