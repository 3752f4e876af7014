package index

// FileFigure is what the access journal keeps of an indexed file: the
// mount it is on, its header id, its last access and hits.
type FileFigure struct {
	Mount int
	FID   uint64
	Last  int64
	Hits  uint32
}

// Restore sets the last access and hits of en, found at Open and not
// yet indexed, to what the access journal kept of its file.
func (en *Entry) Restore(last int64, hits uint32) {
	en.Last, en.hits = last, hits
}

// Figures returns the figures of the entries of ids still indexed whose
// files have a header id (a file without one is never journaled).
func (f *Files) Figures(ids []uint64) []FileFigure {
	f.mu.RLock()
	defer f.mu.RUnlock()
	figs := make([]FileFigure, 0, len(ids))
	for _, id := range ids {
		if en := f.entries[id]; en != nil && en.FID != 0 {
			figs = append(figs, en.figure())
		}
	}
	return figs
}

// MountFigures returns the figures of every indexed entry on mount whose
// file has a header id.
func (f *Files) MountFigures(mount int) []FileFigure {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var figs []FileFigure
	for _, en := range f.entries {
		if en.Mount == mount && en.FID != 0 {
			figs = append(figs, en.figure())
		}
	}
	return figs
}

func (en *Entry) figure() FileFigure {
	return FileFigure{Mount: en.Mount, FID: en.FID, Last: en.Last, Hits: en.hits}
}
