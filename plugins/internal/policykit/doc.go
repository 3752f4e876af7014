// Package policykit holds the data structures kvhost's built-in policies
// share: an open-addressing Table from entry id to slot, a Pool of entries
// with intrusive recency Lists, a Tracker that applies access records with the
// common pin/restore/remove rules, and Names, which builds deterministic file
// names that always pass abi.CheckPath.
//
// Everything here is built for the hot hooks of a plugin (kvhost_access,
// kvhost_name, kvhost_evict): once the working set is allocated, applying a
// record, building a name or walking for victims allocates nothing, and the
// state is a few flat slices, which is what stays fast when compiled to wasm.
//
// The package is internal to plugins/: a vendor writing their own policy can
// copy from it freely, but it is not part of kvhost's public API.
package policykit
