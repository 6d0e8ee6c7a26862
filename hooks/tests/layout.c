/* Prints the budget file's layout as JSON: what vgpu/adapters/budget.py
 * must agree with (tests/hooks/test_layout.py). */
#include <stddef.h>
#include <stdio.h>

#include "../vgpu_shared.h"

int main(void)
{
    printf("{\"file_bytes\": %u, \"sizeof\": %zu, \"magic\": %u, \"version\": %u, "
           "\"max_devices\": %d, \"max_slots\": %d, \"uuid_bytes\": %d, \"slot_lock_base\": %d, "
           "\"file\": \"%s\", \"offsets\": {\"magic\": %zu, \"version\": %zu, \"file_bytes\": %zu, "
           "\"slot_count\": %zu, \"slot_hwm\": %zu, \"device_count\": %zu, \"arbiter\": %zu, \"used\": %zu, "
           "\"devices\": %zu, \"slots\": %zu, \"poll_seq\": %zu, \"teller_at_ns\": %zu, \"told\": %zu, "
           "\"awaiting\": %zu, \"measured\": %zu}, "
           "\"pid_lock_base\": %d, \"slot_bytes\": %zu, "
           "\"slot_offsets\": {\"pid\": %zu, \"host_pid\": %zu, \"used\": %zu}}\n",
           VGPU_SHARED_FILE_BYTES, sizeof(struct vgpu_shared), VGPU_SHARED_MAGIC,
           VGPU_SHARED_VERSION, VGPU_MAX_DEVICES, VGPU_MAX_SLOTS, VGPU_UUID_BYTES,
           VGPU_SLOT_LOCK_BASE, VGPU_SHARED_FILE, offsetof(struct vgpu_shared, magic),
           offsetof(struct vgpu_shared, version), offsetof(struct vgpu_shared, file_bytes),
           offsetof(struct vgpu_shared, slot_count), offsetof(struct vgpu_shared, slot_hwm),
           offsetof(struct vgpu_shared, device_count), offsetof(struct vgpu_shared, arbiter),
           offsetof(struct vgpu_shared, used),
           offsetof(struct vgpu_shared, devices), offsetof(struct vgpu_shared, slots),
           offsetof(struct vgpu_shared, poll_seq), offsetof(struct vgpu_shared, teller_at_ns),
           offsetof(struct vgpu_shared, told), offsetof(struct vgpu_shared, awaiting),
           offsetof(struct vgpu_shared, measured), VGPU_PID_LOCK_BASE,
           sizeof(struct vgpu_slot), offsetof(struct vgpu_slot, pid),
           offsetof(struct vgpu_slot, host_pid), offsetof(struct vgpu_slot, used));
    return 0;
}
