/* missing_dep.c - a library that one loader-test plugin links against and that the test then
 * keeps off the search path, so dlopen fails with "cannot open shared object file". */
int kiln_test_missing_dep(void);
int kiln_test_missing_dep(void) { return 42; }
