package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
)

// EngineMounts is cfg's mounts as the engine takes them, each capacity
// sized or checked by mountCapacity with statfs, which must answer within
// server.statfs_timeout: the error of the first mount that fails it.
func EngineMounts(ctx context.Context, cfg config.Config, statfs func(string) (fsys.StatFS, error)) ([]engine.Mount, error) {
	mounts := make([]engine.Mount, len(cfg.Mounts))
	for i, m := range cfg.Mounts {
		capacity, err := mountCapacity(ctx, m, statfs, time.Duration(cfg.Server.StatfsTimeout))
		if err != nil {
			return nil, err
		}
		mounts[i] = engine.Mount{
			Path: m.Path, Capacity: capacity, CapacityDerived: m.Capacity == 0, HighWatermark: m.HighWatermark, LowWatermark: m.LowWatermark,
			Reserve: int64(m.Reserve), IO: m.IO, NoChecksum: !m.Checksums(), ChecksumEveryLoad: m.ChecksumEveryLoad, LoadReaders: m.LoadReaders, DeviceClass: m.DeviceClass,
			Preallocate:     EnginePreallocate(m.Preallocate),
			ClusterCapacity: int64(m.ClusterCapacity), ClusterInterval: time.Duration(m.ClusterInterval),
		}
		if m.Layout == config.LayoutVLLMFS {
			v := m.VLLMFS
			if v == nil {
				v = &config.VLLMFS{}
			}
			mounts[i].VLLMFS = &engine.VLLMFS{Fields: v.Fields(), Rank: v.Rank, Namespace: v.Namespace, RowBytes: int64(v.RowBytes)}
		}
	}
	return mounts, nil
}

// EnginePreallocate is a mount's preallocate setting as the engine takes
// it: the bytes given, or engine.PreallocateAuto.
func EnginePreallocate(a config.AutoSize) int64 {
	if !a.Given {
		return engine.PreallocateAuto
	}
	return int64(a.Bytes)
}

// mountCapacity is the configured capacity, or 90% of the file system's
// size when it is 0 (docs/config.md), read by statfs (the daemon's file
// system's). Either way the mount's file system must answer that statfs
// (and, without a capacity, the making of the mount's directory) within
// wait (AnswerWithin; server.statfs_timeout): on a hung mount the start
// fails naming it, instead of hanging in the engine's Open. With a
// capacity, a statfs that fails is the engine's to report (the mount's
// directory may not exist yet: the engine makes it).
func mountCapacity(ctx context.Context, m config.Mount, statfs func(string) (fsys.StatFS, error), wait time.Duration) (int64, error) {
	st, err := AnswerWithin(ctx, wait, func() (fsys.StatFS, error) {
		if m.Capacity == 0 {
			if err := os.MkdirAll(m.Path, 0o750); err != nil {
				return fsys.StatFS{}, err
			}
		}
		return statfs(m.Path)
	})
	switch {
	case errors.Is(err, ErrNoAnswer):
		return 0, HungMount(m.Path, err)
	case ctx.Err() != nil:
		return 0, ctx.Err()
	case m.Capacity > 0:
		return int64(m.Capacity), nil
	case err != nil:
		return 0, fmt.Errorf("mount %s: %w", m.Path, err)
	}
	return DefaultCapacity(st.Total), nil
}

// EngineBudgets is the engine's Config.Budgets from cfg's [[budget]]
// tables.
func EngineBudgets(cfg config.Config) []engine.Budget {
	var out []engine.Budget
	for _, b := range cfg.Budgets {
		out = append(out, engine.Budget{Model: b.Model, Bytes: int64(b.Bytes), Floor: int64(b.Floor)})
	}
	return out
}

// DefaultCapacity is the capacity of a mount left 0 on a file system of
// size bytes: 90% of it.
func DefaultCapacity(size int64) int64 { return int64(float64(size) * 0.9) }

// ServerLimits is the session server's configuration from cfg's [server]
// limits and timeouts, as given (zero: the server's default).
func ServerLimits(cfg config.Config) server.Config {
	return server.Config{
		MaxClients:              cfg.Server.MaxClients,
		MaxClientsPerPeer:       cfg.Server.MaxClientsPerPeer,
		MaxNamespacesPerPeer:    cfg.Server.MaxNamespacesPerPeer,
		MaxDescriptors:          cfg.Server.MaxDescriptors,
		MaxPinnedKeys:           cfg.Server.MaxPinnedKeys,
		MaxPinnedKeysPerPeer:    cfg.Server.MaxPinnedKeysPerPeer,
		MaxCacheLayers:          cfg.Server.MaxCacheLayers,
		MaxCacheLayersPerPeer:   cfg.Server.MaxCacheLayersPerPeer,
		MaxDescriptorsPerPeer:   cfg.Server.MaxDescriptorsPerPeer,
		MaxFrame:                int(cfg.Server.MaxFrame),
		MaxRegistrations:        cfg.Server.MaxRegistrations,
		MaxInflightJobs:         cfg.Server.MaxInflightJobs,
		MaxInflightBytes:        int64(cfg.Server.MaxInflightBytes),
		MaxInflightBytesPerPeer: int64(cfg.Server.MaxInflightBytesPerPeer),
		MaxIncomingBytes:        int64(cfg.Server.MaxIncomingBytes),
		MaxIncomingBytesPerPeer: int64(cfg.Server.MaxIncomingBytesPerPeer),
		ShutdownTimeout:         time.Duration(cfg.Server.ShutdownTimeout),
		MaxHandshakes:           cfg.Server.MaxHandshakes,
		HandshakeTimeout:        time.Duration(cfg.Server.HandshakeTimeout),
		FrameTimeout:            time.Duration(cfg.Server.FrameTimeout),
		IdleTimeout:             time.Duration(cfg.Server.IdleTimeout),
		WriteTimeout:            time.Duration(cfg.Server.WriteTimeout),
		MaxRegisteredBytes:      int64(cfg.Server.MaxRegisteredBytes),
		MaxTotalRegisteredBytes: int64(cfg.Server.MaxTotalRegisteredBytes),
		MaxDeviceBytes:          int64(cfg.Server.MaxDeviceRegisteredBytes),
	}
}
