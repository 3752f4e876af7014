package protocol

import "testing"

// TestTypeNamesAllocateNothingForKnownTypes: every type names itself, a
// reply is its request's name with "-reply", an unknown type prints its
// number; naming a known type (a metrics label on every request)
// allocates nothing.
func TestTypeNamesAllocateNothingForKnownTypes(t *testing.T) {
	for _, tc := range []struct {
		t    Type
		want string
	}{
		{TypeHello, "hello"},
		{TypeRegisterMemory, "register-memory"},
		{TypeUnregisterMemory, "unregister-memory"},
		{TypeDeclare, "declare"},
		{TypeRegisterCache, "register-cache"},
		{TypeUnregisterCache, "unregister-cache"},
		{TypeLookup, "lookup"},
		{TypeStore, "store"},
		{TypeLoad, "load"},
		{TypeCancel, "cancel"},
		{TypeDelete, "delete"},
		{TypeStats, "stats"},
		{TypeUndeclare, "undeclare"},
		{TypePin, "pin"},
		{TypeUnpin, "unpin"},
		{TypePinLoadable, "pin-loadable"},
		{TypeGroup, "group"},
		{TypeLookupTable, "lookup-table"},
		{TypePurge, "purge"},
		{TypeLoadLayers, "load-layers"},
		{TypeError, "error"},
		{TypeCompletion, "completion"},
		{TypeLookup | TypeReply, "lookup-reply"},
		{0x0777, "type(0x0777)"},
		{0x0777 | TypeReply, "type(0x8777)"},
	} {
		if got := tc.t.String(); got != tc.want {
			t.Errorf("Type(0x%04x).String() = %q, want %q", uint16(tc.t), got, tc.want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = TypeLookup.String() }); n != 0 {
		t.Errorf("TypeLookup.String() allocates %v times", n)
	}
}
