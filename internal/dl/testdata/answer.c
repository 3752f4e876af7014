/* A tiny library for dl's tests: built with the C compiler at test time. */
int kvhost_dl_answer(void) { return 42; }
