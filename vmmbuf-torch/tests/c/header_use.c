/* The C interface as a C program sees it: compiled against
 * include/vmmbuf.h alone and linked with the plug-in library, it calls the
 * entry points that need no GPU and checks their documented failure
 * answers. Run by .ci/run on a machine without a GPU (a CUDA device only
 * changes what an allocation answers, which it does not assume). */
#include <stdio.h>
#include <string.h>

#include "vmmbuf.h"

static int failures = 0;

static void check(int ok, const char* what) {
    if (!ok) {
        fprintf(stderr, "FAILED: %s\n", what);
        failures++;
    }
}

int main(void) {
    /* Zero bytes: null, and no failure. */
    check(vmmbuf_malloc(0, 0, NULL) == NULL, "0 bytes give null");
    /* A negative size: null, the cause kept for this thread. */
    check(vmmbuf_malloc(-5, 0, NULL) == NULL, "a negative size gives null");
    const char* why = vmmbuf_last_error();
    check(why != NULL && strstr(why, "negative") != NULL, "last_error names the cause");
    /* An unknown pointer: logged, nothing changes, no crash. */
    vmmbuf_free((void*)0x1000, 16, 0, NULL);
    vmmbuf_record_stream((void*)0x1000, NULL);
    check(vmmbuf_free_stream_destroyed((void*)0x1000, 0) == -1, "unknown pointer: -1");
    /* Tags: UTF-8 or nothing. */
    check(vmmbuf_set_tag("weights") == 0, "a tag");
    check(vmmbuf_set_tag("\xff\xfe") == -1, "a tag that is not UTF-8");
    check(vmmbuf_set_tag(NULL) == 0, "no tag");
    /* Captures: an end with none begun is refused; a begin and an end pair. */
    check(vmmbuf_capture_ends() == -1, "an end with none begun");
    vmmbuf_capture_begins();
    check(vmmbuf_capture_ends() == 0, "a begun capture ends");
    /* A sleep mode that does not exist. */
    check(vmmbuf_sleep("weights", 99) == -1, "an unknown sleep mode");
    check(vmmbuf_prepare_sleep(NULL, 99, 1) == -1, "an unknown mode to prepare");
    /* No NCCL registration under an unknown id. */
    check(vmmbuf_nccl_deregister(0, 12345) == -1, "an unknown registration");
    check(vmmbuf_nccl_covers(0, (const void*)0x1000, 16) == 0, "nothing registered");
    if (failures == 0) printf("C interface: every check passed\n");
    return failures == 0 ? 0 : 1;
}
