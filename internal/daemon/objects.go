package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/metrics"
	"github.com/kvhost/kvhost/internal/objstore"
)

// OpenObjects opens the object mount of cfg's [objects] (docs/object.md),
// or returns nil where it names no endpoint. The keys come from the file
// or, where it leaves them out, from $KVHOST_S3_ACCESS_KEY and
// $KVHOST_S3_SECRET_KEY; a secret key file is read here.
func OpenObjects(ctx context.Context, o config.Objects, log *slog.Logger) (*objstore.Store, error) {
	if o.Endpoint == "" {
		return nil, nil
	}
	access, secret := o.AccessKey, os.Getenv("KVHOST_S3_SECRET_KEY")
	if access == "" {
		access = os.Getenv("KVHOST_S3_ACCESS_KEY")
	}
	if o.SecretKeyFile != "" {
		b, err := os.ReadFile(o.SecretKeyFile)
		if err != nil {
			return nil, fmt.Errorf("objects.secret_key_file: %w", err)
		}
		secret, _, _ = strings.Cut(strings.TrimSpace(string(b)), "\n")
	}
	st, err := objstore.Open(ctx, objstore.Config{
		Endpoint: o.Endpoint, Bucket: o.Bucket, Prefix: o.Prefix, Region: o.Region,
		AccessKey: access, SecretKey: secret, CreateBucket: o.CreateBucket,
		RequestTimeout: time.Duration(o.RequestTimeout), PartSize: int64(o.PartSize), RangeSize: int64(o.RangeSize),
		Requests: o.Requests, Uploads: o.Uploads, ListInterval: time.Duration(o.ListInterval),
		Capacity: int64(o.Capacity), Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("object mount ([objects]): %w", err)
	}
	log.Info("object mount", "endpoint", o.Endpoint, "bucket", o.Bucket, "prefix", o.Prefix, "objects", st.Stats().Objects, "bytes", st.Stats().Used, "capacity", int64(o.Capacity))
	return st, nil
}

// ObjectMetrics adapts the object mount's stats to the metrics' snapshot.
func ObjectMetrics(stats func() objstore.Stats) func() metrics.ObjectStats {
	return func() metrics.ObjectStats {
		st := stats()
		return metrics.ObjectStats{
			Keys: st.Objects, Uploaded: st.Uploaded, Skipped: st.Skipped, Failed: st.Failed, Dropped: st.Dropped,
			Gets: st.Gets, GetErrors: st.GetErrors, GetBytes: st.GetBytes, Bad: st.Removed, Deleted: st.Deleted, Listings: st.Listings,
			Evicted: st.Evicted, Purged: st.Purged, Vanished: st.Vanished, Full: st.Full, Used: st.Used,
		}
	}
}
