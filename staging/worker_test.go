package staging

import (
	"context"

	"github.com/kvhost/kvhost/fsys"
)

// The package's tests drive a worker directly, a direction at a time.

// write writes every span to f. Spans must be sorted by offset and must not
// overlap; runs of contiguous spans become single large writes.
func (w *worker) write(ctx context.Context, f fsys.File, spans []span, opt options) (int64, error) {
	return w.do(ctx, f, spans, opt, true)
}

// read fills every span from f. Spans must be sorted by offset and must not
// overlap. Reading past the end of the file fails with ErrShortFile.
func (w *worker) read(ctx context.Context, f fsys.File, spans []span, opt options) (int64, error) {
	return w.do(ctx, f, spans, opt, false)
}
